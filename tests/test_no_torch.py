"""The scheduler, the block manager and the request-side types import and run without torch; so do the test files
of `make test-unit`, the model-free tier."""

import re
import subprocess
import sys

from tests.conftest import REPO_ROOT

CODE = """
import sys
sys.modules['torch'] = None  # any `import torch` now fails
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.block_manager import BlockManager
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.scheduler.sequence import Sequence
from tokenmill.sampling_params import SamplingParams
from tokenmill.outputs import RequestOutput
from tokenmill.config import EngineConfig
bm = BlockManager(8, 4)
s = Scheduler(SchedulerConfig(), KVCacheManager(bm))
s.add(Sequence(0, 'r', [1, 2, 3], SamplingParams()))
assert s.schedule().num_batched_tokens == 3
print('ok')
"""


def test_scheduler_and_block_manager_need_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def unit_test_files() -> list[str]:
    """The files `make test-unit` runs (the Makefile's UNIT_TESTS)."""
    makefile = (REPO_ROOT / "Makefile").read_text().replace("\\\n", " ")
    (files,) = re.findall(r"^UNIT_TESTS := (.+)$", makefile, re.M)
    return files.split()


def test_the_unit_tier_needs_no_torch_and_no_model() -> None:
    """Every test file of `make test-unit` imports without torch (so it builds no model and starts no server):
    a file that comes to need one belongs to `make test-fast` instead."""
    files = unit_test_files()
    assert "tests/test_no_torch.py" in files and len(files) >= 10
    modules = [f.removesuffix(".py").replace("/", ".") for f in files]
    code = "import sys, importlib\nsys.modules['torch'] = None\n" + "".join(
        f"importlib.import_module({m!r})\n" for m in modules
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
