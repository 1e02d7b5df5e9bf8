/* AdamW over one slice of a host chunk in one pass over memory.
 *
 * Reads the gradient (bf16, or fp32 where micro batches add up in fp32), updates the master weight and
 * moments in place, and writes the new weight in the model's dtype (bf16 or fp32: into a buffer of its
 * own, over the gradient it was computed from when that has the weight's dtype, or not at all):
 * 28 bytes per parameter for a bf16 gradient and weight (30 for an fp32 gradient), where converting
 * the gradient up, running fp32 AdamW and converting the weight back moves 40 in three passes.
 * The master is fp32, or (REM) an int16 remainder that with the bf16 weight in `hi` is the exact fp32
 * master: read as the pair, written back as the pair (the new weight is hi itself); the moments are
 * fp32 or bf16 (rounded to nearest even when written), or fp8 (M_FP8, V_FP8: E4M3 codes with an fp32
 * power-of-two scale per FP8_BLOCK elements, exp_avg_sq as its square root; updated a block at a time
 * and written back rounded stochastically, the random bits a hash of the element's index).
 * zero_cache/precision.py says how the pair splits and joins and how fp8 rows are kept, with the same
 * arithmetic in torch.
 * The arithmetic is torch's AdamW (decoupled weight decay, bias corrections, eps outside the square
 * root, the gradient divided by the clipping scale); its rounding differs from torch's kernels by ulps.
 *
 * Built at run time by angelgpt/zero_cache/cpu_adam.py:
 *     cc -O3 -march=native -ffp-contract=off -fno-math-errno -fno-trapping-math -shared -fPIC -pthread cpu_adam.c
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* flags: what each pointer holds */
#define G_BF16 1   /* the gradient is bf16 (else fp32) */
#define OUT_SHIFT 1 /* 2 bits: 0 no weight written, 1 into out (fp32), 2 into out (bf16), 3 over the gradient */
#define REM 8      /* p is the int16 remainder of the master whose bf16 weight is hi (else p is the fp32 master) */
#define M_BF16 16  /* exp_avg is bf16 (else fp32) */
#define V_BF16 32  /* exp_avg_sq is bf16 (else fp32) */
#define M_FP8 64   /* exp_avg is fp8: E4M3 codes in m, a scale per block in ms */
#define V_FP8 128  /* exp_avg_sq is fp8: E4M3 codes of its square root in v, a scale per block in vs */
#define FP8_BLOCK 256

typedef struct {
    void *p, *w, *m, *v;   /* [n] master (fp32, or int16 remainder), bf16 weight (REM), exp_avg, exp_avg_sq */
    void *g;               /* [n] gradient */
    void *out;             /* [n] new weight (out kinds 1 and 2) */
    int64_t lo, hi;        /* the block being updated */
    int flags;
    float decay, beta1, beta2, step_size, bc2_sqrt, eps, scale;
    float *ms, *vs;        /* fp8 moments: [n / FP8_BLOCK, rounded up] scales */
    uint32_t salt_m, salt_v; /* fp8 moments: the random bits' seed per row */
    int64_t base;          /* fp8 moments: the chunk element that element 0 is (the random bits' index) */
} Job;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float join_master(uint16_t w, int16_t r) { /* the weight less its rounding, and the remainder */
    uint32_t u = ((uint32_t)(uint16_t)(w - (r < 0)) << 16) | (uint16_t)r;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void split_master(float f, uint16_t *w, int16_t *r) { /* rounded by the remainder's top bit */
    uint32_t u;
    memcpy(&u, &f, 4);
    *r = (int16_t)(uint16_t)(u & 0xffffu);
    *w = (uint16_t)((u >> 16) + ((u >> 15) & 1u));
}

typedef struct {
    float decay, b1, b2, c1, c2, step_size, bc2_sqrt, eps, scale;
} Hyper;

static inline Hyper hyper(const Job *j) {
    const Hyper h = {j->decay, j->beta1, j->beta2, 1.0f - j->beta1, 1.0f - j->beta2, j->step_size, j->bc2_sqrt,
                     j->eps, j->scale};
    return h;
}

/* One element's AdamW, the one update both loops below run: the gradient and the master read at i, the
 * moments given as read (fp32) and returned updated in *m and *v, the new master written back (fp32, or
 * as the weight and its remainder) and the new weight written where the out kind says. */
static inline __attribute__((always_inline)) void update(const int flags, const Hyper h, const int64_t i,
                                                        void *restrict p, uint16_t *restrict w,
                                                        void *restrict g, void *restrict out, float *m, float *v) {
    const int gb = flags & G_BF16, out_kind = (flags >> OUT_SHIFT) & 3, rem = flags & REM;
    uint16_t *g16 = (uint16_t *)g;
    float *g32 = (float *)g;
    const float gi = (gb ? bf16_to_f32(g16[i]) : g32[i]) / h.scale;
    const float pi = rem ? join_master(w[i], ((int16_t *)p)[i]) : ((float *)p)[i];
    const float mi = h.b1 * *m + h.c1 * gi;
    const float vi = h.b2 * *v + h.c2 * gi * gi;
    const float wi = pi * h.decay - h.step_size * mi / (sqrtf(vi) / h.bc2_sqrt + h.eps);
    if (rem) split_master(wi, &w[i], &((int16_t *)p)[i]);
    else ((float *)p)[i] = wi;
    *m = mi;
    *v = vi;
    if (out_kind == 1) ((float *)out)[i] = wi;
    if (out_kind == 2) ((uint16_t *)out)[i] = f32_to_bf16(wi);
    if (out_kind == 3 && gb) g16[i] = f32_to_bf16(wi); /* same element just read: no alias between i */
    if (out_kind == 3 && !gb) g32[i] = wi;
}

/* one loop, specialised for each combination of flags so that each vectorises */
static inline __attribute__((always_inline)) void run(const Job *j, const int flags) {
    const int mb = flags & M_BF16, vb = flags & V_BF16;
    float *restrict m32 = (float *)j->m, *restrict v32 = (float *)j->v;
    uint16_t *restrict m16 = (uint16_t *)j->m, *restrict v16 = (uint16_t *)j->v;
    const Hyper h = hyper(j);
    for (int64_t i = j->lo; i < j->hi; i++) {
        float mi = mb ? bf16_to_f32(m16[i]) : m32[i];
        float vi = vb ? bf16_to_f32(v16[i]) : v32[i];
        update(flags, h, i, j->p, (uint16_t *)j->w, j->g, j->out, &mi, &vi);
        if (mb) m16[i] = f32_to_bf16(mi);
        else m32[i] = mi;
        if (vb) v16[i] = f32_to_bf16(vi);
        else v32[i] = vi;
    }
}

/* fp8 moments ------------------------------------------------------------------------------- */
/* Written without branches or tables, so that each loop over a block vectorises. */

static inline float e4m3_value(uint8_t c) { /* the NaN codes are never written */
    const uint32_t e = (c >> 3) & 15u, m = c & 7u;
    const uint32_t normal = (e + 120u) << 23 | m << 20; /* (1 + m/8) * 2**(e - 7) */
    float f, sub = (float)m * 0x1p-9f;
    memcpy(&f, &normal, 4);
    const float v = e ? f : sub;
    return c & 128u ? -v : v;
}

static inline uint32_t random_bits(uint32_t salt, uint32_t i) { /* precision.random_bits */
    uint32_t x = i * 0x7FEB352Du + salt;
    x ^= x >> 16;
    x *= 0x2C1B3C6Du;
    x ^= x >> 16;
    x *= 0x297A2D39u;
    return x ^ (x >> 15);
}

static inline uint8_t stochastic_e4m3(float y, uint32_t bits) { /* precision.stochastic_e4m3, encoded */
    uint32_t u; /* (selects as masks, minima and maxima: the loop over a block vectorises) */
    memcpy(&u, &y, 4);
    const uint32_t a = u & 0x7fffffffu;
    const int32_t e = (int32_t)(a >> 23) - 127, r = (int32_t)(bits & 0x7fffffffu);
    int32_t below = -6 - e; /* bits E4M3 keeps fewer than 3 below its normal range (at most 3 here) */
    below = below > 0 ? below : 0;
    below = below < 3 ? below : 3;
    const uint32_t mask = (1u << (20 + below)) - 1u;
    const uint32_t normal = (a + ((uint32_t)r & mask)) & ~mask;
    /* below 2**-9: 2**-9 with probability |y| * 2**9 (|y| capped there, so the product is an int) */
    const uint32_t capped = a < 0x3b000000u ? a : 0x3b000000u;
    float fc;
    memcpy(&fc, &capped, 4);
    const uint32_t small = -(uint32_t)((r & 0xffffff) < (int32_t)(fc * 0x1p33f)) & 0x3b000000u;
    const uint32_t is_small = -(uint32_t)(e < -9);
    const uint32_t q = (small & is_small) | (normal & ~is_small);
    const int32_t qe = (int32_t)(q >> 23) - 127;
    float f;
    memcpy(&f, &q, 4);
    const uint32_t sub = (uint32_t)(int32_t)(f * 512.0f); /* below 2**-6: a multiple of 2**-9 (0 for 0) */
    const uint32_t is_normal = -(uint32_t)(qe >= -6);
    const uint32_t code = (((uint32_t)(qe + 7) << 3 | ((q >> 20) & 7u)) & is_normal) | (sub & ~is_normal);
    return (uint8_t)(code | (u >> 31 << 7));
}

static inline int block_exponent(float amax, int kmin) { /* the power of two over which amax is at most */
    int e;                                                /* 448, at least 2**kmin (precision.MIN_EXPONENT) */
    const float m = frexpf(amax, &e);
    const int k = e - 9 + (m > 0.875f);
    return k < kmin ? kmin : k > 127 ? 127 : k;
}

static void encode_block(const float *restrict x, int n, uint8_t *restrict codes, float *restrict scale,
                         uint32_t salt, int64_t first, int kmin) {
    uint32_t top = 0; /* the largest magnitude, by its bits (their order is the values') */
    for (int k = 0; k < n; k++) {
        uint32_t u;
        memcpy(&u, &x[k], 4);
        u &= 0x7fffffffu;
        top = u > top ? u : top;
    }
    float amax;
    memcpy(&amax, &top, 4);
    const int e = block_exponent(amax, kmin);
    *scale = ldexpf(1.0f, e);
    const float inv = ldexpf(1.0f, -e); /* exact: x * 2**-e is x / 2**e, rounded alike */
    const uint32_t i0 = (uint32_t)first;
    for (int k = 0; k < n; k++) codes[k] = stochastic_e4m3(x[k] * inv, random_bits(salt, i0 + (uint32_t)k));
}

/* AdamW a block of FP8_BLOCK at a time where a moment is fp8: decoded into fp32, updated, encoded;
 * specialised for each combination of flags as `run` is (a non-fp8 moment's dtype beside an fp8 one read
 * from j->flags) */
static inline __attribute__((always_inline)) void run_blocks(const Job *j, const int flags) {
    const int mb = j->flags & M_BF16, vb = j->flags & V_BF16, m8 = flags & M_FP8, v8 = flags & V_FP8;
    float *restrict m32 = (float *)j->m, *restrict v32 = (float *)j->v;
    uint16_t *restrict m16 = (uint16_t *)j->m, *restrict v16 = (uint16_t *)j->v;
    uint8_t *restrict mc = (uint8_t *)j->m, *restrict vc = (uint8_t *)j->v;
    const Hyper h = hyper(j);
    float mo[FP8_BLOCK], vo[FP8_BLOCK];
    for (int64_t lo = j->lo; lo < j->hi; lo += FP8_BLOCK) {
        const int n = (int)(j->hi - lo < FP8_BLOCK ? j->hi - lo : FP8_BLOCK);
        const int64_t b = lo / FP8_BLOCK;
        if (m8) {
            const float s = j->ms[b];
            for (int k = 0; k < n; k++) mo[k] = e4m3_value(mc[lo + k]) * s;
        } else {
            for (int k = 0; k < n; k++) mo[k] = mb ? bf16_to_f32(m16[lo + k]) : m32[lo + k];
        }
        if (v8) {
            const float s = j->vs[b];
            for (int k = 0; k < n; k++) {
                const float x = e4m3_value(vc[lo + k]) * s;
                vo[k] = x * x;
            }
        } else {
            for (int k = 0; k < n; k++) vo[k] = vb ? bf16_to_f32(v16[lo + k]) : v32[lo + k];
        }
        for (int k = 0; k < n; k++) update(flags, h, lo + k, j->p, (uint16_t *)j->w, j->g, j->out, &mo[k], &vo[k]);
        if (m8) {
            encode_block(mo, n, mc + lo, j->ms + b, j->salt_m, j->base + lo, -124);
        } else {
            for (int k = 0; k < n; k++) {
                if (mb) m16[lo + k] = f32_to_bf16(mo[k]);
                else m32[lo + k] = mo[k];
            }
        }
        if (v8) {
            for (int k = 0; k < n; k++) vo[k] = sqrtf(vo[k]);
            encode_block(vo, n, vc + lo, j->vs + b, j->salt_v, j->base + lo, -57);
        } else {
            for (int k = 0; k < n; k++) {
                if (vb) v16[lo + k] = f32_to_bf16(vo[k]);
                else v32[lo + k] = vo[k];
            }
        }
    }
}

#define C1(k) case k: run(j, k); break;
#define C4(k) C1(k) C1(k + 1) C1(k + 2) C1(k + 3)
#define C16(k) C4(k) C4(k + 4) C4(k + 8) C4(k + 12)

#define B1(k) case k: run_blocks(j, k); break;
#define B4(k) B1(k) B1(k + 1) B1(k + 2) B1(k + 3)
#define B16(k) B4(k) B4(k + 4) B4(k + 8) B4(k + 12)

static void range(const Job *j) {
    if (j->flags & (M_FP8 | V_FP8)) { /* the gradient, out and remainder flags and which moments are fp8 */
        switch (j->flags & (M_FP8 | V_FP8 | 15)) {
        B16(M_FP8) B16(V_FP8) B16(M_FP8 | V_FP8)
        }
        return;
    }
    switch (j->flags & 63) {
    C16(0) C16(16) C16(32) C16(48)
    }
}

#define MAX_THREADS 256
#define BLOCK 65536 /* elements a thread takes at a time: 256 KiB of each fp32 state (whole FP8_BLOCKs) */

typedef struct {
    Job job;              /* the whole slice; lo, hi unused */
    int64_t n, next;      /* next: the first element no thread has taken yet */
} Shared;

/* Threads take blocks until none is left, so a thread that the OS runs late (another thread of the
 * process, a busy core) delays the slice by one block, not by a whole static share. */
static void *work(void *arg) {
    Shared *s = (Shared *)arg;
    for (;;) {
        int64_t lo = __atomic_fetch_add(&s->next, BLOCK, __ATOMIC_RELAXED);
        if (lo >= s->n) return NULL;
        Job j = s->job;
        j.lo = lo;
        j.hi = lo + BLOCK < s->n ? lo + BLOCK : s->n;
        range(&j);
    }
}

/* Updates the slice on `threads` threads (the caller is one; a thread that cannot start is left out). */
void angelgpt_adamw(void *p, void *w, void *m, void *v, void *g, void *out, int flags, int64_t n, float decay,
                    float beta1, float beta2, float step_size, float bc2_sqrt, float eps, float scale, int threads,
                    float *ms, float *vs, uint32_t salt_m, uint32_t salt_v, int64_t base) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    if (threads > blocks) threads = (int)blocks;
    Shared s = {{p, w, m, v, g, out, 0, 0, flags, decay, beta1, beta2, step_size, bc2_sqrt, eps, scale, ms, vs, salt_m,
                 salt_v, base}, n, 0};
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, work, &s) == 0;
    work(&s);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], NULL);
}
