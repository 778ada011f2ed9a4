"""The lifecycle of a server of several models (tokenmill/server/model_router/registry.py) with stand-in model
processes: loads on first use (once, however many wait), keep_alive (0 at once, a duration, negative for good), the
least recently used idle model unloaded to stay within --max-loaded-models and --memory-budget, a load that needs
room waiting for a busy model to go idle; Ollama's keep_alive parsing and the catalog's names. No server, no torch:
milliseconds."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from tokenmill.config.server import ServerSettings
from tokenmill.errors import InvalidParameterError
from tokenmill.server.model_router import listing
from tokenmill.server.model_router import registry as registry_module
from tokenmill.server.model_router.app import ps_listing
from tokenmill.server.model_router.catalog import Catalog, ServableModel, scan_models_dir, split_named
from tokenmill.server.model_router.keep_alive import parse_keep_alive
from tokenmill.server.model_router.registry import ModelRegistry

MIB = 2**20


class FakeProcess:
    """A model's process as the registry sees it: started (after a short load), measured, stopped."""

    started: list[str] = []
    rss = 300 * MIB

    def __init__(self, model: ServableModel):
        self.model = model
        self.alive = True
        self.load_seconds = 0.01
        self.url = "http://127.0.0.1:1"

    @classmethod
    async def start(cls, model: ServableModel, settings: ServerSettings, timeout_s: float) -> "FakeProcess":
        await asyncio.sleep(0.01)
        cls.started.append(model.name)
        return cls(model)

    def rss_bytes(self) -> int:
        return self.rss if self.alive else 0

    async def stop(self, grace_s: float = 10.0) -> None:
        self.alive = False


@pytest.fixture(autouse=True)
def fake_processes(monkeypatch):
    FakeProcess.started = []
    monkeypatch.setattr(registry_module, "ModelProcess", FakeProcess)


def models(*names: str) -> dict[str, ServableModel]:
    return {n: ServableModel(n, f"/models/{n}.gguf") for n in names}


def registry(max_loaded: int = 3, budget: int | None = None, keep_alive: float | None = 300.0) -> ModelRegistry:
    return ModelRegistry(ServerSettings(max_loaded_models=max_loaded), keep_alive, budget)


def loaded(reg: ModelRegistry) -> list[str]:
    return sorted(s.model.name for s in reg.loaded())


async def use(reg: ModelRegistry, model: ServableModel, keep_alive: float | None = 300.0) -> None:
    slot = await reg.acquire(model)
    reg.release(slot, keep_alive)


def test_keep_alive_is_parsed_as_ollama_does() -> None:
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive("2.5s") == 2.5
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0 and parse_keep_alive("300") == 300
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None and parse_keep_alive(12.5) == 12.5
    for bad in ("soon", "5 minutes", "", True, [], "m5"):
        with pytest.raises(InvalidParameterError, match="keep_alive"):
            parse_keep_alive(bad)


def test_names_and_a_models_folder(tmp_path: Path) -> None:
    assert split_named("chat=smollm2-135m") == ("chat", "smollm2-135m")
    assert split_named("org/name-GGUF:Q4_K_M") == (None, "org/name-GGUF:Q4_K_M")
    (tmp_path / "odd=name.gguf").write_bytes(b"GGUF")
    assert split_named(str(tmp_path / "odd=name.gguf")) == (None, str(tmp_path / "odd=name.gguf"))
    for name in ("a.gguf", "big-00001-of-00002.gguf", "big-00002-of-00002.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"GGUF")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    (tmp_path / "checkpoint" / "model.safetensors").write_bytes(b"")
    found = [m.name for m in scan_models_dir(tmp_path)]
    assert found == ["a", "big-00001-of-00002", "checkpoint", "odd=name"]
    catalog = Catalog([ServableModel("first", "/x.gguf", ("alias",))], str(tmp_path), hub_cache=False)
    assert catalog.default.name == "first" and catalog.find("alias:latest").name == "first"
    assert catalog.find("a:latest").path == str(tmp_path / "a.gguf") and catalog.find("nope") is None


def test_a_model_loads_once_however_many_wait() -> None:
    async def run() -> None:
        reg = registry()
        m = models("a")["a"]
        slots = await asyncio.gather(*(reg.acquire(m) for _ in range(5)))
        assert FakeProcess.started == ["a"] and slots[0].active == 5
        for slot in slots:
            reg.release(slot, 300.0)
        assert slots[0].active == 0 and loaded(reg) == ["a"]

    asyncio.run(run())


def test_the_least_recently_used_idle_model_makes_room() -> None:
    async def run() -> None:
        reg = registry(max_loaded=2)
        m = models("a", "b", "c")
        await use(reg, m["a"])
        await use(reg, m["b"])
        await use(reg, m["a"])  # b is the least recently used now
        await use(reg, m["c"])
        assert loaded(reg) == ["a", "c"]
        await use(reg, m["b"])
        assert loaded(reg) == ["b", "c"]

    asyncio.run(run())


def test_the_memory_budget_counts_resident_memory() -> None:
    async def run() -> None:
        # each takes 300 MiB once loaded; one never loaded yet is expected to take its file and 512 MiB (here
        # no file): a and b fit in 900 MiB (300 + 512, then 600), c beside them would not (600 + 512)
        reg = registry(budget=900 * MIB)
        m = models("a", "b", "c")
        await use(reg, m["a"])
        await use(reg, m["b"])
        assert loaded(reg) == ["a", "b"]
        await use(reg, m["c"])
        assert loaded(reg) == ["b", "c"]
        alone = registry(budget=100 * MIB)  # a model alone loads whatever the budget
        await use(alone, m["a"])
        assert loaded(alone) == ["a"]

    asyncio.run(run())


def test_keep_alive_zero_a_duration_and_forever() -> None:
    async def run() -> None:
        reg = registry()
        m = models("a", "b", "c")
        await use(reg, m["a"], keep_alive=0.0)
        await asyncio.sleep(0.01)
        assert loaded(reg) == []
        await use(reg, m["b"], keep_alive=0.05)
        assert loaded(reg) == ["b"] and reg.slots["b"].expires_at is not None
        await use(reg, m["c"], keep_alive=None)
        assert reg.slots["c"].expires_at is None
        await asyncio.sleep(0.15)
        assert loaded(reg) == ["c"]

    asyncio.run(run())


def test_a_load_that_needs_room_waits_for_a_busy_model() -> None:
    async def run() -> None:
        reg = registry(max_loaded=1)
        m = models("a", "b")
        busy = await reg.acquire(m["a"])
        waiting = asyncio.ensure_future(reg.acquire(m["b"]))
        await asyncio.sleep(0.1)
        assert not waiting.done() and loaded(reg) == ["a"]
        reg.release(busy, 300.0)
        slot = await asyncio.wait_for(waiting, 5)
        assert loaded(reg) == ["b"] and slot.active == 1

    asyncio.run(run())


def test_an_unload_asked_while_busy_happens_when_idle() -> None:
    async def run() -> None:
        reg = registry()
        m = models("a")["a"]
        slot = await reg.acquire(m)
        await reg.unload_when_idle(slot)
        assert loaded(reg) == ["a"]  # its request still runs
        reg.release(slot, 300.0)
        await asyncio.sleep(0.01)
        assert loaded(reg) == []

    asyncio.run(run())


def test_the_hub_caches_models_are_servable_and_read_again_when_it_changes(monkeypatch) -> None:
    from tokenmill.server.model_router import catalog as catalog_module

    cached = [ServableModel("org/tiny-GGUF:Q4_1", "/cache/tiny-Q4_1.gguf", source="Hub cache")]
    reads = []
    monkeypatch.setattr(catalog_module, "hub_cache_models", lambda: reads.append(1) or list(cached))
    catalog = Catalog([ServableModel("first", "/x.gguf")])
    assert [m.name for m in catalog.all()] == ["first", "org/tiny-GGUF:Q4_1"]
    assert catalog.find("first").name == "first" and catalog.default.name == "first"
    assert catalog.find("org/tiny-GGUF:Q4_1").path == "/cache/tiny-Q4_1.gguf" and len(reads) == 1  # read once
    cached.clear()
    catalog.forget_hub_cache()  # a delete: read again
    assert catalog.find("org/tiny-GGUF:Q4_1") is None and len(reads) == 2


def test_api_ps_leaves_out_a_model_that_unloads_while_it_lists(monkeypatch) -> None:
    """/api/ps gathers each loaded model's details (its context length from its process, its file's facts in a
    thread); a model whose keep_alive runs out meanwhile is left out, where its entry made the list a 500."""

    async def run() -> None:
        reg = registry()
        both = models("a", "b")
        for m in both.values():
            await use(reg, m)
        slot_a = reg.slots["a"]

        def facts_while_a_unloads(model: ServableModel) -> None:
            if model.name == "a":
                slot_a.process = None  # what the registry's unload leaves
            return None

        class NoAnswer:
            async def get(self, *args, **kwargs):
                raise ConnectionError("no process there")

        monkeypatch.setattr(listing, "facts_of", facts_while_a_unloads)
        answer = await ps_listing(SimpleNamespace(registry=reg, client=NoAnswer()), SimpleNamespace(headers={}))
        assert [m["name"] for m in answer["models"]] == ["b:latest"]
        assert answer["models"][0]["size"] == FakeProcess.rss

    asyncio.run(run())
