"""Messages are packed into one byte buffer and read back as views: every dtype and shape survives,
bit for bit, at an offset the allocator would have chosen."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.runtime.transport import _ALIGN, _FIELDS, _HEADER, _pack, _packed_bytes, _unpack

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool]
DTYPES.append(torch.complex64)


@st.composite
def tensor_lists(draw: st.DrawFn) -> list[torch.Tensor]:
    result = []
    for _ in range(draw(st.integers(0, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * 100
        result.append(values.to(dtype) if dtype is not torch.bool else values > 0)
    return result


@settings(max_examples=150, deadline=None)
@given(tensors=tensor_lists(), header=st.booleans(), prefix=st.binary(max_size=100))
def test_packed_tensors_read_back_bit_for_bit_and_aligned(
    tensors: list[torch.Tensor], header: bool, prefix: bytes
) -> None:
    specs = [(t.dtype, tuple(t.shape)) for t in tensors]
    fields = (1, 2, 3) if header else None
    buffer = _pack(fields, b"" if header else prefix, tensors, torch.device("cpu"))
    start = _HEADER if header else -(-len(prefix) // _ALIGN) * _ALIGN
    assert buffer.dtype == torch.uint8 and buffer.numel() == start + _packed_bytes(specs)
    if header:
        assert buffer[:_FIELDS].view(torch.int64).tolist() == [1, 2, 3]
    else:
        assert bytes(buffer[: len(prefix)].tolist()) == prefix
    views = _unpack(buffer, start, specs)
    for view, tensor in zip(views, tensors, strict=True):
        assert view.dtype == tensor.dtype and view.shape == tensor.shape
        assert torch.equal(view.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
        assert view.data_ptr() % _ALIGN == buffer.data_ptr() % _ALIGN  # same alignment as the buffer's start
        if tensor.numel():  # a view of the buffer, not a copy (received messages are handed out uncopied)
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert buffer.data_ptr() <= view.data_ptr() < buffer.data_ptr() + buffer.numel()


def test_a_non_contiguous_tensor_is_packed_by_value() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    (view,) = _unpack(_pack((0, 0, 0), b"", [base.t()], torch.device("cpu")), _HEADER, [(torch.float32, (4, 3))])
    assert torch.equal(view, base.t())
