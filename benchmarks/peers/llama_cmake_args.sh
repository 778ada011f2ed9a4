#!/usr/bin/env bash
# CMAKE_ARGS for building llama.cpp (llama-cpp-python) with every SIMD extension this CPU has, except AMX:
# on the project's VM the CPU reports AMX but the first tile instruction dies with SIGILL (the hypervisor does
# not enable the tile state), so a -march=native build cannot run.
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
echo "-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)" \
  "-DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)" \
  "-DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=$(has avx_vnni)" \
  "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
