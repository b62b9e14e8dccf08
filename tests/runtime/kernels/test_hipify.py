"""The ROCm path of csrc/cuda: PyTorch's extension builder hipifies the CUDA sources on a ROCm
build before compiling them. No ROCm compiler exists here, so this runs that same translation
(torch.utils.hipify, as cpp_extension calls it for an extension) on a copy of csrc/ and checks
that every CUDA source comes out as HIP: its CUDA headers, launches and includes all translated.
Compiling and running the result needs a ROCm machine.
"""

import re
import shutil

from torch.utils.hipify import hipify_python

from runtime.kernels.paths import CSRC


def test_every_cuda_source_hipifies(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    results = hipify_python.hipify(
        project_directory=str(csrc),
        output_directory=str(csrc),
        header_include_dirs=[],
        includes=[str(csrc / "*")],
        extra_files=[],
        show_detailed=False,
        show_progress=False,
        is_pytorch_extension=True,
        hipify_extra_files_only=False,
    )
    cuda_sources = sorted(p for p in (csrc / "cuda").iterdir() if p.suffix in {".cu", ".cuh"})
    assert cuda_sources
    for source in cuda_sources:
        result = results[str(source)]
        assert result.status == "[ok]", (source.name, result.status)
        hip = tmp_path.joinpath(result.hipified_path)
        assert hip != source and hip.exists(), (source.name, result.hipified_path)
        text = hip.read_text()
        assert "<<<" not in text, f"{hip.name}: a CUDA launch was left"
        assert not re.search(r"#include\s*[<\"]c10/cuda/", text), f"{hip.name}: a CUDA header"
        for include in re.findall(r'#include\s*"([^"]+)"', text):
            if include == "hip/hip_runtime.h":  # ROCm's, which hipify adds
                continue
            assert (hip.parent / include).exists(), f"{hip.name} includes {include}, not there"
