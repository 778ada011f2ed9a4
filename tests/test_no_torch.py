"""The scheduler, the block manager and the request-side types import and run without torch."""

import subprocess
import sys

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
