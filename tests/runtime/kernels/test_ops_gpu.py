"""The CUDA kernels against the CPU ones, bit for bit (device machine only: this needs a GPU and a
CUDA build of PyTorch with the kernels built)."""

import pytest
import torch

from runtime import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or kernels.backend() != "compiled",
        reason="needs a GPU and the compiled kernels",
    ),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.uint8])
def test_checksum_is_the_same_on_the_gpu(dtype):
    x = (torch.randn(513, 129) * 100).to(dtype)
    for offset in ((0, 0), (7, 3)):
        shape = (513 + offset[0], 129 + offset[1])
        assert kernels.checksum(x.cuda(), shape, offset) == kernels.checksum(x, shape, offset)


def test_pack_and_unpack_match_the_cpu():
    tensors = [
        torch.randn(64, 48),
        torch.arange(1000, dtype=torch.int32).view(10, 100),
        torch.randn(33),
    ]
    slices = torch.tensor([[0, 1, 5, 20], [1, 0, 2, 5], [2, 0, 1, 31]], dtype=torch.int64)
    on_gpu = kernels.pack([t.cuda() for t in tensors], slices)
    assert torch.equal(on_gpu.cpu(), kernels.pack(tensors, slices))
    restored = [torch.zeros_like(t).cuda() for t in tensors]
    kernels.unpack(on_gpu, restored, slices)
    for (i, dim, start, length), t in zip(slices.tolist(), restored, strict=True):
        assert torch.equal(
            t.cpu().narrow(dim, start, length), tensors[i].narrow(dim, start, length)
        )


def test_tensors_on_another_device_are_refused_before_any_byte_is_written():
    slices = torch.tensor([[0, 0, 0, 2], [1, 0, 0, 2]], dtype=torch.int64)
    on_gpu, on_cpu = torch.zeros(4, 4).cuda(), torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="every tensor must be on the buffer's device"):
        kernels.unpack(torch.full((64,), 7, dtype=torch.uint8).cuda(), [on_gpu, on_cpu], slices)
    assert not on_gpu.any() and not on_cpu.any()
    out = torch.zeros(64, dtype=torch.uint8).cuda()
    with pytest.raises(RuntimeError, match="every tensor must be on the buffer's device"):
        kernels.pack([torch.ones(4, 4).cuda(), torch.ones(4, 4)], slices, out=out)
    assert not out.any()
    # The CUDA ops themselves (kernels.* hands mixed devices to the reference, which refuses
    # them with the same message), the buffer on the CPU as well as on the GPU.
    for buffer in (
        torch.full((64,), 7, dtype=torch.uint8),
        torch.full((64,), 7, dtype=torch.uint8).cuda(),
    ):
        with pytest.raises(
            RuntimeError, match="unpack: every tensor must be on the buffer's device"
        ):
            torch.ops.nereus.unpack(buffer, [on_gpu, on_cpu], slices)
    with pytest.raises(
        RuntimeError, match="pack_into: every tensor must be on the buffer's device"
    ):
        torch.ops.nereus.pack_into([torch.ones(4, 4).cuda(), torch.ones(4, 4)], slices, out)
    with pytest.raises(RuntimeError, match="pack: every tensor must be on the buffer's device"):
        torch.ops.nereus.pack([torch.ones(4, 4).cuda(), torch.ones(4, 4)], slices)
    assert not on_gpu.any() and not on_cpu.any() and not out.any()


def test_slices_on_the_gpu_among_cpu_tensors_are_refused_by_name():
    """Found by review: the dispatcher goes by every tensor argument, so GPU slices with CPU
    tensors ran the CUDA kernels on CPU addresses. They are refused, naming the slices; slices on
    the CPU or on the tensors' GPU are both fine."""
    rows = torch.tensor([[0, 0, 0, 4]], dtype=torch.int64)
    message = r"{}: slices must be on the CPU or on the buffer's device \(cpu\), not cuda"
    destination, out = torch.zeros(4), torch.zeros(16, dtype=torch.uint8)
    buffer = torch.full((16,), 7, dtype=torch.uint8)
    for unpack in (kernels.unpack, torch.ops.nereus.unpack):
        with pytest.raises(RuntimeError, match=message.format("unpack")):
            unpack(buffer, [destination], rows.cuda())
    with pytest.raises(RuntimeError, match=message.format("pack_into")):
        torch.ops.nereus.pack_into([torch.ones(4)], rows.cuda(), out)
    with pytest.raises(RuntimeError, match=message.format("pack")):
        torch.ops.nereus.pack([torch.ones(4)], rows.cuda())
    assert not destination.any() and not out.any()
    for slices in (rows, rows.cuda()):
        packed = kernels.pack([torch.ones(4).cuda()], slices)
        assert torch.equal(packed.cpu(), torch.ones(4).view(torch.uint8))
