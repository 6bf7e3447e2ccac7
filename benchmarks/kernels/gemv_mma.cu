// A candidate for decode steps of 4-16 sequences, not yet in the engine: pagedserve's GEMV (model/gemv.cu) on
// the tensor cores. Compiled after model/gemv.cu's text, whose macros (K, WARPS, UNROLL, ROWS, NORM, SILU_MUL)
// and helpers (stream_load, wait_and_stage_x, to_bf16) it uses; `python -m benchmarks.kernels.gemv --cuda
// --rows 4,8,16` times it against cuBLAS and the engine's CUDA-core GEMV and checks it against an fp32 product.
__device__ __forceinline__ void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#define NT ((ROWS + 7) / 8)                        // mma n-tiles of 8 rows of x
#define WPIECES (PIECES / WARPS)                   // a warp's share of a weight row
#define WSTEPS (WPIECES / (4 * UNROLL))            // a warp's steps along its share of a tile

// The same stream on the tensor cores, for more rows of x than the CUDA cores keep up with. A CTA owns
// tiles of 16 weight rows (tile b, b + grid, ...) and its warps split each tile's reduction, warp w taking
// pieces [w, w + 1) x WPIECES, so that even a 4096-row weight (256 tiles) keeps every warp of every SM
// streaming. Lane (g = lane / 4, t = lane % 4) loads 16-byte pieces of rows g and g + 8, UNROLL a step, the
// 4 lanes of a group 64 contiguous bytes of a row. The reduction index of an m16n8k16 mma may be permuted as
// long as A and B share it: k slots {2t, 2t+1, 2t+8, 2t+9} of one mma are values 0-3 of lane t's piece, of
// the next mma values 4-7, so each lane's A and B fragments are its own 16-byte pieces as loaded (W's rows
// g, g + 8; x's row g from shared memory). The warps' sums of a tile meet in shared memory (two buffers, so
// one barrier a tile), where each thread adds up one output's.
extern "C" __global__ void BOUNDS gemv_bf16_mma(const uint4* __restrict__ W, const uint4* __restrict__ X,
                                           bf16_t* __restrict__ Y, int N, const uint4* __restrict__ R,
                                           const uint4* __restrict__ NW, uint4* __restrict__ ROut, double eps) {
    extern __shared__ uint4 xs[];  // ROWS x PIECES, then the warps' sums: 2 x WARPS x NT x 32 lanes x 4
    float* red = reinterpret_cast<float*>(xs + ROWS * PIECES);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int tiles = N / 16;
    const uint4* Wp = W + (long)g * PIECES + warp * WPIECES + t;  // this lane's first piece of a tile's row g
    int tile = blockIdx.x, step = 0;
    uint4 next[2][UNROLL];
    if (tile < tiles) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint4* p = Wp + (long)tile * 16 * PIECES + 4 * u;
            next[0][u] = stream_load(p);
            next[1][u] = stream_load(p + 8 * PIECES);
        }
    }
    wait_and_stage_x(xs, X, R, NW, ROut, eps);
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    int buf = 0;
    while (tile < tiles) {
        uint4 cur[2][UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) { cur[0][u] = next[0][u]; cur[1][u] = next[1][u]; }
        int ntile = tile, nstep = step + 1;
        if (nstep == WSTEPS) { nstep = 0; ntile += gridDim.x; }
        if (ntile < tiles) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint4* p = Wp + (long)ntile * 16 * PIECES + nstep * 4 * UNROLL + 4 * u;
                next[0][u] = stream_load(p);
                next[1][u] = stream_load(p + 8 * PIECES);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int piece = warp * WPIECES + step * 4 * UNROLL + 4 * u + t;
            const uint4 a = cur[0][u], a8 = cur[1][u];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int r = 8 * j + g;  // x's row in this lane's B fragment (zero past ROWS)
                const uint4 b = r < ROWS ? xs[r * PIECES + piece] : make_uint4(0, 0, 0, 0);
                mma_bf16(acc[j], a.x, a8.x, a.y, a8.y, b.x, b.y);
                mma_bf16(acc[j], a.z, a8.z, a.w, a8.w, b.z, b.w);
            }
        }
        if (step == WSTEPS - 1) {
            float* mine = red + ((buf * WARPS + warp) * NT * 32 + lane) * 4;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
#pragma unroll
                for (int c = 0; c < 4; ++c) mine[j * 128 + c] = acc[j][c];
                acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            }
            __syncthreads();
            // output (j, l, c): c0, c1 weight row g(l), x rows 8j + 2t(l), +1; c2, c3 weight row g(l) + 8
            for (int i = threadIdx.x; i < NT * 128; i += WARPS * 32) {
                const int j = i >> 7, l = (i >> 2) & 31, c = i & 3;
                const int m = 8 * j + 2 * (l & 3) + (c & 1), n = tile * 16 + (l >> 2) + (c >> 1) * 8;
                if (m < ROWS) {
                    float sum = 0.f;
#pragma unroll
                    for (int w = 0; w < WARPS; ++w) sum += red[(buf * WARPS + w) * NT * 128 + i];
                    Y[(long)m * N + n] = to_bf16(sum);
                }
            }
            buf ^= 1;
        }
        tile = ntile;
        step = nstep;
    }
}
