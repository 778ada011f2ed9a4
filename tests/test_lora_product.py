"""LoRA's low-rank products (layers/lora.py over native/lowrank.c): a row's result is the same bits whatever rows
share the call and however many threads run it, and the float64 product's values."""

import pytest
import torch

from tests.vector_paths import OTHER_PATHS, rerun_on_path
from tokenmill import native
from tokenmill.layers.lora import LoRAProjection
from tokenmill.native.threads import set_threads

# (inputs, rank, outputs): a fused QKV at rank 8+8+8, an MLP down projection at rank 16, odd sizes (a last partial
# run of 16 inputs, a rank that is not a multiple of 4)
SHAPES = [(64, 24, 128), (128, 16, 64), (70, 5, 33)]


def projection(inputs: int, rank: int, outputs: int, seed: int) -> LoRAProjection:
    g = torch.Generator().manual_seed(seed)
    return LoRAProjection.of(torch.randn(rank, inputs, generator=g) * 0.1, torch.randn(outputs, rank, generator=g))


@pytest.mark.parametrize(("inputs", "rank", "outputs"), SHAPES)
def test_a_row_gets_the_same_bits_in_any_call(inputs: int, rank: int, outputs: int) -> None:
    assert native.load() is not None
    lora = projection(inputs, rank, outputs, 0)
    x = torch.randn(200, inputs, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([lora.product(x[i : i + 1]) for i in range(200)])
    b = lora.b_blocks.transpose(0, 1).reshape(rank, -1)[:, :outputs]  # B^T [R, out]
    reference = (x.double() @ lora.a.double().T) @ b.double()
    assert torch.allclose(alone.double(), reference, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            set_threads(count, native.load())
            for start, n in [(0, 200), (3, 1), (7, 2), (10, 17), (0, 64), (150, 50)]:
                assert torch.equal(lora.product(x[start : start + n]), alone[start : start + n]), (count, start, n)
    finally:
        set_threads(threads, native.load())


def test_the_rows_of_an_index_and_of_a_run_are_added_as_alone() -> None:
    """add_to over gathered rows (an index: scattered back with index_add_) and over a run (a view) gives each row
    what its product alone adds."""
    lora = projection(64, 8, 96, 2)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(3))
    base = torch.randn(12, 96, generator=torch.Generator().manual_seed(4))
    for rows in (torch.tensor([1, 4, 5, 9]), slice(2, 8)):
        out = base.clone()
        lora.add_to(out, x, rows)
        picked = torch.arange(12)[rows]
        for i in range(12):
            expected = base[i] + lora.product(x[i : i + 1])[0] if i in picked else base[i]
            assert torch.equal(out[i], expected), (rows, i)


@pytest.mark.slow
@pytest.mark.parametrize(("march", "path"), OTHER_PATHS)
def test_the_avx2_and_portable_paths_pass_these_tests(march: str, path: str) -> None:
    """This machine builds the AVX-512 path; older CPUs get other code for the same loops: build it and rerun."""
    rerun_on_path(__file__, march, path, "not avx2_and_portable")  # the child runs all but this test
