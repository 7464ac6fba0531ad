"""scripts/build_llama_cpp.sh names each GGML CPU feature from /proc/cpuinfo, AMX off."""
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_llama_cpp.sh"
INTEL = "fpu avx avx2 fma f16c bmi2 avx512f avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_tile amx_int8"
EPYC = "fpu avx avx2 fma f16c bmi2 avx512f avx512vbmi avx512_vnni avx512_bf16"  # no AVX-VNNI
OLD = "fpu sse4_2 avx"


def _args(tmp_path, flags: str) -> dict[str, str]:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    out = subprocess.run(["bash", str(SCRIPT), "--print"], env={"CPUINFO": str(info), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout.split()
    return dict(a.removeprefix("-D").split("=") for a in out)


@pytest.mark.parametrize("flags,vnni,avx512", [(INTEL, "ON", "ON"), (EPYC, "OFF", "ON"), (OLD, "OFF", "OFF")])
def test_features_follow_the_cpu(tmp_path, flags, vnni, avx512):
    a = _args(tmp_path, flags)
    assert a["GGML_NATIVE"] == "OFF" and a["GGML_AVX_VNNI"] == vnni and a["GGML_AVX512"] == avx512
    assert a["GGML_AMX_INT8"] == a["GGML_AMX_TILE"] == a["GGML_AMX_BF16"] == "OFF"  # even where the CPU has AMX
    assert a["GGML_AVX"] == "ON" and a["GGML_AVX2"] == ("OFF" if flags == OLD else "ON")


def test_tools_build_the_three_tools_with_the_same_features(tmp_path):
    # a fake cmake records its arguments; an unpacked source tree is taken as it is (no download)
    bin_dir, src = tmp_path / "bin", tmp_path / "tools" / "llama.cpp"
    bin_dir.mkdir()
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    log = tmp_path / "cmake.log"
    (bin_dir / "cmake").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bin_dir / "cmake").chmod(0o755)
    info = tmp_path / "cpuinfo"
    info.write_text(f"flags\t\t: {EPYC}\n")
    out = subprocess.run(["bash", str(SCRIPT), "--tools", str(tmp_path / "tools")], capture_output=True, text=True,
                         env={"CPUINFO": str(info), "PATH": f"{bin_dir}:/usr/bin:/bin"}, check=True).stdout
    configure, build = log.read_text().splitlines()
    assert f"-S {src} -B {tmp_path / 'tools' / 'build'}" in configure
    assert "-DGGML_AVX_VNNI=OFF" in configure and "-DGGML_AMX_INT8=OFF" in configure  # as --print says
    assert "-DGGML_AVX512_VNNI=ON" in configure and "-DBUILD_SHARED_LIBS=OFF" in configure
    assert build.endswith("--target llama-perplexity llama-imatrix llama-quantize")
    assert out.split() == [str(tmp_path / "tools" / "build" / "bin" / t)
                           for t in ("llama-perplexity", "llama-imatrix", "llama-quantize")]


def test_tools_needs_a_directory():
    proc = subprocess.run(["bash", str(SCRIPT), "--tools"], capture_output=True, text=True)
    assert proc.returncode != 0 and "--tools DIR" in proc.stderr
