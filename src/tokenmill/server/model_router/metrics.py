"""/metrics of a server of several models: each loaded model's own metrics (its server's /metrics: tokenmill:*,
vLLM's names, and llamacpp:*), every sample labelled with `model_name` as vLLM labels them, merged into one family
per name; then this server's: which models are loaded, how often and how long each took to load."""

import asyncio
from collections.abc import Iterable, Iterator

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from tokenmill.server.model_router.catalog import ServableModel
from tokenmill.server.model_router.registry import Slot


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def labelled(text: str, model_name: str) -> list[Metric]:
    """A model's exposition as metric families, `model_name` added to every sample."""
    families = []
    for family in text_string_to_metric_families(text):
        family.samples = [s._replace(labels={**s.labels, "model_name": model_name}) for s in family.samples]
        families.append(family)
    return families


def merged(per_model: list[list[Metric]]) -> list[Metric]:
    """One family per name, its samples from every model (a name twice in one exposition is invalid)."""
    by_name: dict[str, Metric] = {}
    for families in per_model:
        for family in families:
            first = by_name.setdefault(family.name, family)
            if first is not family:
                first.samples.extend(family.samples)
    return list(by_name.values())


def own_families(
    models: list[ServableModel], slots: dict[str, Slot], loads: dict[str, int], load_seconds: dict[str, float]
) -> list[Metric]:
    loaded = GaugeMetricFamily("tokenmill:model_loaded", "1 while the model is loaded", labels=["model_name"])
    count = CounterMetricFamily("tokenmill:model_loads", "Times the model was loaded", labels=["model_name"])
    seconds = GaugeMetricFamily(
        "tokenmill:model_load_seconds", "Seconds the model's last load took", labels=["model_name"]
    )
    for m in models:
        slot = slots.get(m.name)
        loaded.add_metric([m.name], 1.0 if slot is not None and slot.loaded else 0.0)
        count.add_metric([m.name], float(loads.get(m.name, 0)))
        if m.name in load_seconds:
            seconds.add_metric([m.name], load_seconds[m.name])
    return [loaded, count, seconds]


async def scrape(client: httpx.AsyncClient, slots: list[Slot], headers: dict[str, str]) -> list[list[Metric]]:
    """Each loaded model's families (a model that does not answer, or unloads meanwhile, is left out)."""

    async def one(slot: Slot) -> list[Metric]:
        process = slot.process
        if process is None:
            return []
        try:
            response = await client.get(f"{process.url}/metrics", headers=headers, timeout=10.0)
        except httpx.TransportError:
            return []
        if response.status_code != 200:
            return []
        return await asyncio.to_thread(labelled, response.text, slot.model.name)

    return list(await asyncio.gather(*(one(s) for s in slots)))


def exposition(families: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)
