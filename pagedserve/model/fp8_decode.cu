// fp8 (e4m3) paged decode attention for Hopper: one CTA of WARPS warps per (decoding sequence, KV head).
//
// Why CUDA and not Triton: the Triton kernel stages K/V tiles through shared memory, and with fp8 bytes it
// stayed well below a bf16 decode's bandwidth (docs/lab-notes.md). Here the key loop has no shared
// memory and no barriers: each thread loads its own K/V bytes global -> registers with 16-byte loads,
// prefetched one 16-key step ahead, converts them with cvt.rn.f16x2.e4m3x2 (+ prmt for V) and feeds
// mma.sync m16n8k16 (f16 in, f32 accumulate). The kernel waits on its memory stream, not on issue: each
// warp also asks L2 for its lines PREFETCH steps ahead (prefetch.global.L2 holds no register; the first
// ones before the loop), which puts more bytes in flight than a deeper register prefetch could at 3 CTAs
// an SM, and its loads mark the lines evict-first, as each is read once (docs/lab-notes.md).
//   S  = Q K^T  : M = 16 rows (the G query heads of this KV head, the rest zero), N = 8 keys, K = 16 d.
//   O^T = V^T P^T: M = 16 d an m-tile, N = 8 (the G heads, the rest padding), K = 16 keys.
// P^T's B fragment (keys 2t,2t+1 ; head g) is exactly S's accumulator (head g ; keys 2t,2t+1): no shuffles.
// Head-dim permutations keep every thread's bytes contiguous:
//   QK k-step s, k index j in {2t,2t+1,2t+8,2t+9}  <->  d = 32t + 4s + {0,1,2,3}
//   PV m-tile i, row g / g+8                        <->  d = 16g + 2i / 16g + 2i + 1
// Warp w takes 16-key steps w, w+WARPS, ...; the warps' partial (m, l, acc) merge through shared memory.
// No headers: bf16 travels as its bits, so NVRTC needs no CUDA include directory.
// Compiled per (WARPS, G, BLOCK_SIZE); HEAD_DIM is 128 and the scores run in base 2 (scale folded into q).
typedef unsigned char uint8_t;
typedef unsigned short bf16_t;
typedef unsigned int uint32_t;

#define HEAD_DIM 128
#define STEP 16
#ifndef WARPS
#define WARPS 4
#endif
#ifndef G
#define G 4  // query heads a KV head, 1..8 (the PV tile holds 8)
#endif
#ifndef BLOCK_SIZE
#define BLOCK_SIZE 16  // the cache's block size, a multiple of STEP
#endif
#ifndef PREFETCH
#define PREFETCH 3  // steps ahead a warp asks L2 for its K/V lines (0: none)
#endif
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t x) { return __uint_as_float((uint32_t)x << 16); }
__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void cvt4(uint32_t w, uint32_t& lo, uint32_t& hi) {  // four e4m3 -> two f16x2
    asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.rn.f16x2.e4m3x2 %0, a; cvt.rn.f16x2.e4m3x2 %1, b; }"
        : "=r"(lo), "=r"(hi) : "r"(w));  // bytes 0,1 -> lo (byte 0 in the low half), bytes 2,3 -> hi
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {  // lo in the low half
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// K/V bytes are read once: evict-first keeps L2 for the lines prefetched ahead
__device__ __forceinline__ uint4 load_once(const uint4* p, unsigned long long policy) {
    uint4 r;
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(policy));
    return r;
}

// lanes 0-15 ask L2 for the K line (128 bytes) of one of the step's 16 keys, lanes 16-31 for its V line
__device__ __forceinline__ void prefetch_step(const uint8_t* K, const uint8_t* V, const int* table, int step,
                                              int stride_b, int stride_s, int lane) {
    const int key = step * STEP + (lane & 15);
    const uint8_t* line = (lane < 16 ? K : V) + (long)table[key / BLOCK_SIZE] * stride_b
                          + (long)(key % BLOCK_SIZE) * stride_s;
    asm volatile("prefetch.global.L2 [%0];" :: "l"(line));
}

struct StepLoad { uint4 k[2][2]; uint4 v[4]; };  // K: n-tile x 32 bytes; V: 4 keys x 16 bytes

// this thread's rows of one 16-key step: K keys n*8+g (d 32t..), V keys 2t, 2t+1, 2t+8, 2t+9 (d 16g..);
// koff/voff: their byte offsets within a step, fixed for the whole loop
__device__ __forceinline__ void load_step(StepLoad& st, const uint8_t* K, const uint8_t* V, const int* table,
                                          int step, int seq_len, int stride_b, int stride_s,
                                          const int* koff, const int* voff, int lane, unsigned long long policy) {
    const int g = lane >> 2, t = lane & 3;
    const int key0 = step * STEP;
    const long base = (long)table[key0 / BLOCK_SIZE] * stride_b + (long)(key0 % BLOCK_SIZE) * stride_s;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        const uint4* p = reinterpret_cast<const uint4*>(K + base + koff[n]);
        if (key0 + n * 8 + g < seq_len) { st.k[n][0] = load_once(p, policy); st.k[n][1] = load_once(p + 1, policy); }
        else { st.k[n][0] = make_uint4(0, 0, 0, 0); st.k[n][1] = make_uint4(0, 0, 0, 0); }
    }
    const int vkeys[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const uint4* p = reinterpret_cast<const uint4*>(V + base + voff[r]);
        st.v[r] = key0 + vkeys[r] < seq_len ? load_once(p, policy) : make_uint4(0, 0, 0, 0);
    }
}

__device__ __forceinline__ uint32_t word(const uint4& x, int i) {
    return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

#if PREFETCH > 0
#define MIN_CTAS (12 / WARPS)  // the prefetch's address math would take 178 registers: keep 12 warps an SM
#else
#define MIN_CTAS 1
#endif
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS)
fp8_paged_decode(const bf16_t* __restrict__ Q, const uint8_t* __restrict__ Kc, const uint8_t* __restrict__ Vc,
                 bf16_t* __restrict__ Out, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                 const int* __restrict__ query_start, const int* __restrict__ tile_seq, double qk_scale_log2_d,
                 int stride_qt, int stride_qh, int stride_kvb, int stride_kvs, int stride_kvh, int stride_bt,
                 int stride_ot, int stride_oh) {
    const float qk_scale_log2 = (float)qk_scale_log2_d;
    const int tile = blockIdx.x, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int seq = tile_seq[tile];
    const int qrow = query_start[seq];
    const int seq_len = seq_lens[seq];
    const int* table = block_tables + (long)seq * stride_bt;
    const uint8_t* K = Kc + kvh * stride_kvh;
    const uint8_t* V = Vc + kvh * stride_kvh;

    // Q as the A operand, rows = heads (g < G real), scaled into base 2 and rounded to fp16
    uint32_t qa[8][2];  // per k-step: a0 (d 2t,2t+1 -> 32t+4s+{0,1}), a2 (-> 32t+4s+{2,3}); a1 = a3 = 0
    {
        const bool real = g < G;
        const bf16_t* q = Q + (long)qrow * stride_qt + (long)(kvh * G + (real ? g : 0)) * stride_qh + 32 * t;
        uint4 raw[4];  // this thread's 32 contiguous bf16 (64 bytes, 16-byte aligned: checked by the launcher)
#pragma unroll
        for (int i = 0; i < 4; ++i) raw[i] = real ? __ldg(reinterpret_cast<const uint4*>(q) + i) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const uint32_t w0 = word(raw[s >> 1], 2 * (s & 1)), w1 = word(raw[s >> 1], 2 * (s & 1) + 1);
            qa[s][0] = pack_h2(__uint_as_float(w0 << 16) * qk_scale_log2, __uint_as_float(w0 & 0xffff0000u) * qk_scale_log2);
            qa[s][1] = pack_h2(__uint_as_float(w1 << 16) * qk_scale_log2, __uint_as_float(w1 & 0xffff0000u) * qk_scale_log2);
        }
    }

    float acc[8][4];  // O^T m-tile i: c0 (d 16g+2i, head 2t), c1 (.., head 2t+1), c2/c3 (d 16g+2i+1, ..)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m = NEG_INF, l = 0.f;  // of head g (lanes with g >= G carry padding rows)

    const int koff[2] = {g * stride_kvs + 32 * t, (8 + g) * stride_kvs + 32 * t};
    const int voff[4] = {2 * t * stride_kvs + 16 * g, (2 * t + 1) * stride_kvs + 16 * g,
                          (2 * t + 8) * stride_kvs + 16 * g, (2 * t + 9) * stride_kvs + 16 * g};
    const int steps = (seq_len + STEP - 1) / STEP;
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#pragma unroll
    for (int i = 1; i < PREFETCH; ++i)  // the loop prefetches from step warp + PREFETCH * WARPS on
        if (warp + i * WARPS < steps) prefetch_step(K, V, table, warp + i * WARPS, stride_kvb, stride_kvs, lane);
    StepLoad cur, nxt;
    int s = warp;
    if (s < steps) load_step(cur, K, V, table, s, seq_len, stride_kvb, stride_kvs, koff, voff, lane, policy);
    for (; s < steps; s += WARPS) {
        if (s + WARPS < steps) load_step(nxt, K, V, table, s + WARPS, seq_len, stride_kvb, stride_kvs, koff, voff, lane, policy);
        if (PREFETCH > 0 && s + PREFETCH * WARPS < steps)
            prefetch_step(K, V, table, s + PREFETCH * WARPS, stride_kvb, stride_kvs, lane);
        // S = Q K^T over two n-tiles of 8 keys
        float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        float sc_odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // odd k-steps: two chains of 4, not one of 8
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int k = 0; k < 8; ++k) {  // k-step k: bytes 4k .. 4k+3 of this thread's 32 (d 32t + 4k ..)
                uint32_t b0, b1;
                cvt4(word(cur.k[n][k >> 2], k & 3), b0, b1);
                mma(k & 1 ? sc_odd[n] : sc[n], qa[k][0], 0u, qa[k][1], 0u, b0, b1);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) sc[n][j] += sc_odd[n][j];
        }
        // online softmax of head g over keys n*8 + 2t, +1 (c0, c1); c2/c3 are padding rows
        const int key0 = s * STEP;
        float x[4] = {sc[0][0], sc[0][1], sc[1][0], sc[1][1]};
        const int kx[4] = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};
        float mx = NEG_INF;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (key0 + kx[j] >= seq_len) x[j] = NEG_INF;
            mx = fmaxf(mx, x[j]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m, mx);
        const float m_safe = m_new == NEG_INF ? 0.f : m_new;
        const float alpha = exp2f(m - m_safe);
        float p[4], ps = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) { p[j] = exp2f(x[j] - m_safe); ps += p[j]; }
        ps += __shfl_xor_sync(0xffffffff, ps, 1);
        ps += __shfl_xor_sync(0xffffffff, ps, 2);
        l = l * alpha + ps;
        m = m_new;
        // acc columns are heads 2t, 2t+1: their alphas live in lanes 4*(2t) and 4*(2t+1)
        const float a_lo = __shfl_sync(0xffffffff, alpha, (8 * t) & 31);
        const float a_hi = __shfl_sync(0xffffffff, alpha, (8 * t + 4) & 31);
#pragma unroll
        for (int i = 0; i < 8; ++i) { acc[i][0] *= a_lo; acc[i][1] *= a_hi; acc[i][2] *= a_lo; acc[i][3] *= a_hi; }
        // P^T as the B operand: b0 = (keys 2t, 2t+1 ; head g), b1 = (keys 2t+8, 2t+9 ; head g)
        const uint32_t pb0 = pack_h2(p[0], p[1]), pb1 = pack_h2(p[2], p[3]);
        // V^T as the A operand of m-tile i: rows d 16g+2i (a0, a2) and 16g+2i+1 (a1, a3), keys as above
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // word w of the 16 bytes: d 16g + 4w .. +3 -> m-tiles 2w, 2w+1
            const uint32_t v0 = word(cur.v[0], w), v1 = word(cur.v[1], w), v8 = word(cur.v[2], w), v9 = word(cur.v[3], w);
            const uint32_t lo01 = prmt(v0, v1, 0x5140), hi01 = prmt(v0, v1, 0x7362);  // [v0b0 v1b0 v0b1 v1b1], [.. b2 .. b3]
            const uint32_t lo89 = prmt(v8, v9, 0x5140), hi89 = prmt(v8, v9, 0x7362);
            uint32_t a0, a1, a2, a3;
            cvt4(lo01, a0, a1);  // d 16g+4w (row g) and 16g+4w+1 (row g+8), keys 2t, 2t+1
            cvt4(lo89, a2, a3);  // the same d, keys 2t+8, 2t+9
            mma(acc[2 * w], a0, a1, a2, a3, pb0, pb1);
            cvt4(hi01, a0, a1);  // d 16g+4w+2, +3
            cvt4(hi89, a2, a3);
            mma(acc[2 * w + 1], a0, a1, a2, a3, pb0, pb1);
        }
        cur = nxt;
    }

    // merge the warps' partials: per warp m[G], l[G], acc[G][HEAD_DIM]
    __shared__ float sm_ml[WARPS][G][2];
    __shared__ float sm_acc[WARPS][G][HEAD_DIM];
    if (t == 0 && g < G) { sm_ml[warp][g][0] = m; sm_ml[warp][g][1] = l; }
    if (t < G / 2) {  // lanes holding real heads 2t, 2t+1 in their acc columns
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int d0 = 16 * g + 2 * i;
            sm_acc[warp][2 * t][d0] = acc[i][0];
            sm_acc[warp][2 * t + 1][d0] = acc[i][1];
            sm_acc[warp][2 * t][d0 + 1] = acc[i][2];
            sm_acc[warp][2 * t + 1][d0 + 1] = acc[i][3];
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < HEAD_DIM; d += WARPS * 32)  // one head-dim column a thread, all G heads
#pragma unroll
    for (int h = 0; h < G; ++h) {
        float mm = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_ml[w][h][0]);
        const float ms = mm == NEG_INF ? 0.f : mm;
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float e = sm_ml[w][h][1] > 0.f ? exp2f(sm_ml[w][h][0] - ms) : 0.f;
            num += e * sm_acc[w][h][d];
            den += e * sm_ml[w][h][1];
        }
        Out[(long)qrow * stride_ot + (long)(kvh * G + h) * stride_oh + d] = f32_to_bf16(den > 0.f ? num / den : 0.f);
    }
}
