"""A matrix product for a few rows on CUDA: ``x @ w.T`` for 2 to 16 rows through one kernel of mlxd's own.

Why: a batched decode step multiplies a handful of rows (one per stream) by every weight matrix of the model. MLX
0.32 runs one row through its own matrix-vector kernel, but two rows and more through cuBLASLt, which costs the
host 23-30 µs a call (descriptors, an algorithm heuristic, stream capture; no plan is kept). A Qwen3-8B step has
252 projections, so from two rows on the host needs 6-8 ms a step for them while the device needs about 5: the
batch is bound by the host (``docs/benchmarks/engine.md``).

The kernel here is an MLX custom CUDA kernel (``mx.fast.cuda_kernel``): an ordinary kernel node in MLX's graph,
10-19 µs of host time a call on an H200 (``benchmarks/small_batch_matmul.py``). It reads each weight once for all rows, with tensor cores
(``mma.sync`` m16n8k16: the rows, padded to 16, times 8 weight rows at a time) and float32 accumulation:

- a warp owns ``TILES`` groups of 8 output columns and walks a share of K in chunks of 64; the block's ``WARPS``
  warps split K between them and add their partial sums in shared memory;
- within a chunk each lane loads 2 x 16 contiguous bytes of its weight row and of its two input rows. The order of
  the K positions inside a chunk does not change a dot product, so the lanes feed the tensor cores the positions
  they loaded, the same permutation for the inputs and the weights, and no shuffles are needed;
- a warp issues the loads of its next chunk before the products of this one (double-buffered registers).

Numbers (Qwen3-8B shapes, ``docs/benchmarks/engine.md``): the same results as MLX's matmul to the last bit without
a bias, within float32 rounding of its fused bias add with one. One step's 252 projections at 8 rows: on an H200
5.6-6.7 ms in all against 5.3-8.4 through cuBLASLt, with 2.8-4.7 ms of host time against 4.5-8.0; on an H100 7.0-7.4
ms against 7.6-7.9, host 2.9-3.3 against 6.6-7.0. The engine then gains more than the projections alone show, since
the host time it frees is what the step's other operations need.

It serves bfloat16 and float16 weights whose K is a multiple of 64 and N a multiple of 8 (every projection of the
models mlxd serves); anything else, float32 and quantized layers included, stays on MLX's matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

MAX_ROWS = 16
CHUNK = 64  # K positions a warp takes at a time: 4 lanes x 16 values per weight row

_HEADER = """
// The element type a pointer parameter points to (the signature MLX writes names the inputs' types).
template <typename P> struct pointee;
template <typename U> struct pointee<const U*> { using type = U; };

template <bool BF16>
__device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, const uint32_t* b) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// 16 values of one row at k and k + 32 (a lane's share of a 64-wide chunk), as 8 packed pairs; zeros if !valid.
template <typename T>
__device__ __forceinline__ void load_share(uint32_t* out, const T* row, int k, bool valid) {
  uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
  if (valid) {
    lo = __ldg(reinterpret_cast<const uint4*>(row + k));
    hi = __ldg(reinterpret_cast<const uint4*>(row + k + 32));
  }
  out[0] = lo.x; out[1] = lo.y; out[2] = lo.z; out[3] = lo.w;
  out[4] = hi.x; out[5] = hi.y; out[6] = hi.z; out[7] = hi.w;
}
"""

_SOURCE = """
  const int K = w_shape[1];
  const int N = w_shape[0];
  int rows = 1;
  for (int d = 0; d < x_ndim - 1; ++d) rows *= x_shape[d];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * TILES * 8;

  float acc[TILES][4];
  #pragma unroll
  for (int i = 0; i < TILES; ++i) { acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f; }

  const T* x_lo = x + (size_t)g * K;
  const T* x_hi = x + (size_t)(g + 8) * K;
  const int C = K / 64;
  uint32_t a_lo[8], a_hi[8], b[TILES][8];
  auto fetch = [&](int c) {
    const int k = c * 64 + t * 8;
    load_share<T>(a_lo, x_lo, k, g < rows && c < C);
    load_share<T>(a_hi, x_hi, k, g + 8 < rows && c < C);
    #pragma unroll
    for (int i = 0; i < TILES; ++i) {
      const int n = n0 + i * 8 + g;
      load_share<T>(b[i], w + (size_t)n * K, k, n < N && c < C);
    }
  };
  fetch(warp);
  for (int c = warp; c < C; c += WARPS) {
    uint32_t ca_lo[8], ca_hi[8], cb[TILES][8];
    #pragma unroll
    for (int e = 0; e < 8; ++e) { ca_lo[e] = a_lo[e]; ca_hi[e] = a_hi[e]; }
    #pragma unroll
    for (int i = 0; i < TILES; ++i) {
      #pragma unroll
      for (int e = 0; e < 8; ++e) cb[i][e] = b[i][e];
    }
    fetch(c + WARPS);
    #pragma unroll
    for (int i = 0; i < TILES; ++i) {
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t a[4] = {ca_lo[2 * j], ca_hi[2 * j], ca_lo[2 * j + 1], ca_hi[2 * j + 1]};
        mma_16816<IS_BF16>(acc[i], a, cb[i] + 2 * j);
      }
    }
  }

  __shared__ float partial[WARPS][TILES * 128];
  #pragma unroll
  for (int i = 0; i < TILES; ++i) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) partial[warp][i * 128 + lane * 4 + e] = acc[i][e];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < TILES * 128; idx += WARPS * 32) {
    float sum = 0.0f;
    #pragma unroll
    for (int v = 0; v < WARPS; ++v) sum += partial[v][idx];
    const int i = idx / 128, r = idx % 128;
    const int l = r / 4, e = r % 4;
    const int row = l / 4 + (e >= 2 ? 8 : 0);
    const int col = n0 + i * 8 + (l % 4) * 2 + (e & 1);
    if (row < rows && col < N) {
      ADD_BIAS
      y[(size_t)row * N + col] = static_cast<T>(sum);
    }
  }
"""


@cache
def _kernel(has_bias: bool, bf16: bool, tiles: int, warps: int) -> Any:
    """The kernel of one variant, its constants written into its source. MLX also takes them as ``template``
    arguments of each call, but then formats them into the kernel's name and source on every call: 0.7 µs more a
    call on an H100 (``docs/benchmarks/engine.md``), 252 calls a decode step of Qwen3-8B. MLX keeps compiled
    kernels by name, so every variant has its own."""
    import mlx.core as mx

    constants = (f"  using T = typename pointee<decltype(x)>::type;\n  constexpr bool IS_BF16 = {str(bf16).lower()};\n"
                 f"  constexpr int TILES = {tiles};\n  constexpr int WARPS = {warps};\n")
    bias = "sum += static_cast<float>(bias[col]);" if has_bias else ""
    name = f"mlxd_small_batch_matmul_{'bf16' if bf16 else 'f16'}_t{tiles}_w{warps}{'_bias' if has_bias else ''}"
    return mx.fast.cuda_kernel(name=name, input_names=["x", "w", "bias"] if has_bias else ["x", "w"],
                               output_names=["y"], header=_HEADER, source=constants + _SOURCE.replace("ADD_BIAS", bias))


def fits(weight: Any) -> bool:
    """Whether this kernel can multiply by ``weight`` (shape N x K)."""
    import mlx.core as mx

    n, k = weight.shape
    return weight.dtype in (mx.bfloat16, mx.float16) and k % CHUNK == 0 and n % 8 == 0


def shape_for(n: int, k: int) -> tuple[int, int]:
    """Warps a block and column groups of 8 a warp, for an N x K weight. Large N or K: 4 groups (fewer input reads
    per weight read); long K: 4 warps (each walks a longer share of K; 15% faster for Qwen3-8B's 4096 x 12288 down
    projection on an H200); else 8 warps of 2 groups (enough blocks to fill the device)."""
    tiles = 4 if n >= 8192 or k >= 8192 else 2
    return (4 if k >= 8192 else 8), tiles


@dataclass(frozen=True, slots=True)
class Launch:
    """What a call for one weight passes to the kernel, worked out once (a decode step makes hundreds of calls)."""

    has_bias: bool
    bf16: bool
    tiles: int
    warps: int
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    columns: int
    dtypes: list  # the output's dtype (the weight's), as the call takes it


def plan(weight: Any, has_bias: bool, *, warps: int = 0, tiles: int = 0) -> Launch:
    """The launch for ``weight``; ``warps`` and ``tiles`` override :func:`shape_for` (0: its choice)."""
    import mlx.core as mx

    n, k = weight.shape
    warps, tiles = warps or shape_for(n, k)[0], tiles or shape_for(n, k)[1]
    blocks = -(-n // (8 * tiles))
    return Launch(has_bias, weight.dtype == mx.bfloat16, tiles, warps, (blocks * warps * 32, 1, 1), (warps * 32, 1, 1),
                  n, [weight.dtype])


def run(launch: Launch, x: Any, weight: Any, bias: Any = None) -> Any:
    """``x @ weight.T (+ bias)`` for ``x`` of shape (..., K), 2 to ``MAX_ROWS`` rows, ``weight``'s dtype."""
    inputs = [x, weight] if bias is None else [x, weight, bias]
    kernel = _kernel(launch.has_bias, launch.bf16, launch.tiles, launch.warps)
    return kernel(inputs=inputs, grid=launch.grid, threadgroup=launch.threadgroup,
                  output_shapes=[(*x.shape[:-1], launch.columns)], output_dtypes=launch.dtypes)[0]


def small_batch_matmul(x: Any, weight: Any, bias: Any = None, *, warps: int = 0, tiles: int = 0) -> Any:
    """``x @ weight.T (+ bias)`` in one call (benchmarks and checks; layers keep their :class:`Launch`)."""
    return run(plan(weight, bias is not None, warps=warps, tiles=tiles), x, weight, bias)
