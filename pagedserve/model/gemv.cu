// bf16 GEMV for decode steps of one or two sequences: y[r, n] = sum_k W[n, k] * x[r, k] for each of ROWS rows
// of x, fp32 accumulation.
//
// Why not cuBLAS: at one row cuBLAS picks tiles that leave multiprocessors idle or need a second kernel
// (split-K plus a reduce; the profiles are in docs/lab-notes.md). Here one CTA of WARPS warps sits on each
// SM, every warp owns whole rows (rows r, r + all warps, ...), and each lane streams its 16-byte pieces
// of a row one step of UNROLL loads ahead, across row boundaries, so the loads never drain until the
// warp's last row. x is staged once per CTA in shared memory while the first W loads are in flight.
// ROWS > 1: every weight piece loaded is multiplied by each row of x (a sum a row in each lane), so a decode
// step of ROWS sequences reads its weights once, as one sequence's does; x then lives in dynamic shared
// memory (ROWS x K values may pass the 48 KB a static array can hold).
// SILU_MUL: x is [gate | up] (2K values) and the kernel multiplies silu(gate) by up as it stages it,
// rounding as the separate silu-mul kernel does, so down_proj needs no kernel before it.
// NORM: x is the un-normalised hidden state; each CTA stages RMSNorm(x + residual) * norm weight (rounding
// as fused.rms_norm does) and CTA 0 writes x + residual out as the next residual, so the norm before q/k/v
// and before gate/up needs no kernel either (HAS_RESIDUAL 0: the first layer's norm, of x alone).
// Launched with programmatic dependent launch (sm_90+), a GEMV's CTAs start while the kernel before is
// still running: they put their first W loads in flight, then wait (griddepcontrol.wait) for that kernel's
// output before staging x, and let the next GEMV start as soon as x is staged. The weight stream of one
// projection thus overlaps the tail of the previous one instead of starting after it. ptxas may legally hoist
// the wait above those loads, which undoes this: benchmarks/kernels/gemv_sass.py checks every variant's SASS.
// STAGED: before the wait, each warp also copies its first STAGED chunks (a chunk: one step's UNROLL loads
// of 32 lanes) into shared memory with cp.async, which holds no registers. Meant for the projection after
// the attention kernel, whose CTAs leave room on the SMs and whose reads are few: o_proj's CTAs sit beside
// it and most of o_proj's weights arrive while attention runs. Each lane reads back only what it copied.
// No headers: bf16 travels as its bits, so NVRTC needs no CUDA include directory.
typedef unsigned short bf16_t;
typedef unsigned int uint32_t;

#ifndef K
#define K 4096  // the reduction length: K / 8 a multiple of 32 * UNROLL
#endif
#ifndef WARPS
#define WARPS 16
#endif
#ifndef UNROLL
#define UNROLL 8
#endif
#ifndef SILU_MUL
#define SILU_MUL 0
#endif
#ifndef NORM
#define NORM 0
#endif
#ifndef HAS_RESIDUAL
#define HAS_RESIDUAL 0
#endif
#ifndef STAGED
#define STAGED 0
#endif
#ifndef ROWS
#define ROWS 1
#endif
#if STAGED && ROWS > 1
#error "STAGED copies beside one sequence's attention: ROWS 1 only"
#endif
#ifdef MIN_CTAS  // CTAs a multiprocessor must hold at once: caps the registers a thread may use
#define BOUNDS __launch_bounds__(WARPS * 32, MIN_CTAS)
#else
#define BOUNDS __launch_bounds__(WARPS * 32)
#endif
#define PIECES (K / 8)            // 16-byte pieces of a row
#define STEPS (PIECES / (32 * UNROLL))  // a warp's steps along one row

__device__ __forceinline__ float lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ bf16_t to_bf16(float x) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ uint32_t pack(float a, float b) {  // a in the low half
    return (uint32_t)to_bf16(a) | ((uint32_t)to_bf16(b) << 16);
}
__device__ __forceinline__ uint4 stream_load(const uint4* p) {  // read once: keep it out of L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ const uint4* chunk_at(const uint4* W, int row, int step, int lane) {  // u = 0's piece
    return W + (long)row * PIECES + step * 32 * UNROLL + lane;
}
__device__ __forceinline__ void copy_async(uint4* dst, const uint4* src) {  // 16 bytes, global to shared
    unsigned int d;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(d) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
    acc = fmaf(lo(w.x), lo(x.x), acc); acc = fmaf(hi(w.x), hi(x.x), acc);
    acc = fmaf(lo(w.y), lo(x.y), acc); acc = fmaf(hi(w.y), hi(x.y), acc);
    acc = fmaf(lo(w.z), lo(x.z), acc); acc = fmaf(hi(w.z), hi(x.z), acc);
    acc = fmaf(lo(w.w), lo(x.w), acc); acc = fmaf(hi(w.w), hi(x.w), acc);
    return acc;
}
#if SILU_MUL
__device__ __forceinline__ float silu_times(float g, float u) {  // bf16(bf16(silu(g)) * u), as fused.silu_mul
    const float s = lo(to_bf16(g / (1.f + __expf(-g))));
    return s * u;
}
__device__ __forceinline__ uint32_t silu_mul2(uint32_t g, uint32_t u) {
    return pack(silu_times(lo(g), lo(u)), silu_times(hi(g), hi(u)));
}
#endif

__device__ __forceinline__ uint32_t add2(uint32_t a, uint32_t b) { return pack(lo(a) + lo(b), hi(a) + hi(b)); }
__device__ __forceinline__ float sq2(uint32_t a) { return lo(a) * lo(a) + hi(a) * hi(a); }
__device__ __forceinline__ uint32_t scale2(uint32_t h, float inv, uint32_t w) {  // bf16(bf16(h * inv) * w)
    return pack(lo(to_bf16(lo(h) * inv)) * lo(w), lo(to_bf16(hi(h) * inv)) * hi(w));
}

// Stages x into shared memory (every variant), after the caller has put its first W loads in flight.
__device__ __forceinline__ void stage_x(uint4* xs, const uint4* X, const uint4* R, const uint4* NW, uint4* ROut,
                                        double eps) {
#if NORM
    __shared__ float part[ROWS][WARPS];
    float ss[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) ss[r] = 0.f;
    for (int i = threadIdx.x; i < PIECES; i += WARPS * 32) {
        uint4 h[ROWS];  // every row's reads in flight at once
#pragma unroll
        for (int r = 0; r < ROWS; ++r) h[r] = X[r * PIECES + i];
#if HAS_RESIDUAL
        uint4 res[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) res[r] = R[r * PIECES + i];
#endif
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#if HAS_RESIDUAL
            h[r] = make_uint4(add2(h[r].x, res[r].x), add2(h[r].y, res[r].y), add2(h[r].z, res[r].z),
                              add2(h[r].w, res[r].w));
            if (blockIdx.x == 0) ROut[r * PIECES + i] = h[r];
#endif
            xs[r * PIECES + i] = h[r];
            ss[r] += sq2(h[r].x) + sq2(h[r].y) + sq2(h[r].z) + sq2(h[r].w);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss[r] += __shfl_xor_sync(0xffffffff, ss[r], o);
        if ((threadIdx.x & 31) == 0) part[r][threadIdx.x >> 5] = ss[r];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        ss[r] = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) ss[r] += part[r][w];
        const float inv = 1.f / sqrtf(ss[r] / K + (float)eps);
        for (int i = r * PIECES + threadIdx.x; i < (r + 1) * PIECES; i += WARPS * 32) {  // the pieces it staged
            const uint4 h = xs[i], w = NW[i - r * PIECES];
            xs[i] = make_uint4(scale2(h.x, inv, w.x), scale2(h.y, inv, w.y), scale2(h.z, inv, w.z),
                               scale2(h.w, inv, w.w));
        }
    }
#else
    for (int i = threadIdx.x; i < PIECES; i += WARPS * 32) {
#if SILU_MUL  // a row of x is [gate | up]: 2 x PIECES
        uint4 g[ROWS], u[ROWS];  // every row's reads in flight at once
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            g[r] = X[2 * r * PIECES + i];
            u[r] = X[(2 * r + 1) * PIECES + i];
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            xs[r * PIECES + i] = make_uint4(silu_mul2(g[r].x, u[r].x), silu_mul2(g[r].y, u[r].y),
                                            silu_mul2(g[r].z, u[r].z), silu_mul2(g[r].w, u[r].w));
#else
        uint4 v[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) v[r] = X[r * PIECES + i];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) xs[r * PIECES + i] = v[r];
#endif
    }
#endif
}

// After the first W loads are in flight: wait for the kernel before (its output is x), stage x, then let the
// next kernel launch, as programmatic dependent launch allows on sm_90+.
__device__ __forceinline__ void wait_and_stage_x(uint4* xs, const uint4* X, const uint4* R, const uint4* NW,
                                                 uint4* ROut, double eps) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous kernel's output (x) is complete
#endif
    stage_x(xs, X, R, NW, ROut, eps);
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// X, Y, R, ROut: ROWS rows each, row-major; R, NW, ROut, eps: the residual, norm weight, residual out and
// epsilon of NORM (unused otherwise).
extern "C" __global__ void BOUNDS gemv_bf16(const uint4* __restrict__ W, const uint4* __restrict__ X,
                                           bf16_t* __restrict__ Y, int N, const uint4* __restrict__ R,
                                           const uint4* __restrict__ NW, uint4* __restrict__ ROut, double eps) {
#if ROWS == 1
    __shared__ uint4 xs[PIECES];
#else
    extern __shared__ uint4 xs[];  // ROWS x PIECES
#endif
    const int lane = threadIdx.x & 31;
    const int stride = gridDim.x * WARPS;
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5), step = 0;
    uint4 next[UNROLL];
#if STAGED
    extern __shared__ uint4 staged[];  // WARPS * STAGED chunks (dynamic shared memory)
    uint4* mine = staged + (threadIdx.x >> 5) * (STAGED * UNROLL * 32) + lane;
    int lrow = row, lstep = 0, chunks = 0;  // then the chunk after the staged ones goes to registers
    for (; chunks < STAGED && lrow < N; ++chunks) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            copy_async(mine + (chunks * UNROLL + u) * 32, chunk_at(W, lrow, lstep, lane) + u * 32);
        if (++lstep == STEPS) { lstep = 0; lrow += stride; }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
#else
    const int lrow = row, lstep = 0;
#endif
    if (lrow < N) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) next[u] = stream_load(chunk_at(W, lrow, lstep, lane) + u * 32);
    }
    wait_and_stage_x(xs, X, R, NW, ROut, eps);
#if STAGED
    asm volatile("cp.async.wait_all;" ::: "memory");  // this thread's copies have landed
    int chunk = 0;
#endif
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    while (row < N) {
        uint4 cur[UNROLL];
#if STAGED
        const bool from_shared = chunk++ < chunks;
        if (from_shared) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) cur[u] = mine[(chunk - 1) * UNROLL * 32 + u * 32];
        } else
#else
        const bool from_shared = false;
#endif
        {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) cur[u] = next[u];
        }
        const int piece0 = step * 32 * UNROLL + lane;
        int nrow = row, nstep = step + 1;
        if (nstep == STEPS) { nstep = 0; nrow += stride; }
        if (nrow < N && !from_shared) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) next[u] = stream_load(chunk_at(W, nrow, nstep, lane) + u * 32);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] = dot8(cur[u], xs[r * PIECES + piece0 + u * 32], acc[r]);
        }
        if (step == STEPS - 1) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffff, acc[r], o);
                if (lane == 0) Y[(long)r * N + row] = to_bf16(acc[r]);
                acc[r] = 0.f;
            }
        }
        row = nrow;
        step = nstep;
    }
}
