/* AdamW over one slice of a host chunk in one pass over memory.
 *
 * Reads the gradient (bf16, or fp32 where micro batches add up in fp32), updates the master weight and
 * moments in place, and writes the new weight in the model's dtype (bf16 or fp32: into a buffer of its
 * own, over the gradient it was computed from when that has the weight's dtype, or not at all):
 * 28 bytes per parameter for a bf16 gradient and weight (30 for an fp32 gradient), where converting
 * the gradient up, running fp32 AdamW and converting the weight back moves 40 in three passes.
 * The master is fp32, or (REM) an int16 remainder that with the bf16 weight in `hi` is the exact fp32
 * master: read as the pair, written back as the pair (the new weight is hi itself); the moments are
 * fp32 or bf16 (rounded to nearest even when written). zero_cache/precision.py says how the pair
 * splits and joins, with the same arithmetic in torch.
 * The arithmetic is torch's AdamW (decoupled weight decay, bias corrections, eps outside the square
 * root, the gradient divided by the clipping scale); its rounding differs from torch's kernels by ulps.
 *
 * Built at run time by angelgpt/zero_cache/cpu_adam.py:
 *     cc -O3 -march=native -fno-math-errno -fno-trapping-math -shared -fPIC -pthread cpu_adam.c
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

typedef struct {
    void *p, *w, *m, *v;   /* [n] master (fp32, or int16 remainder), bf16 weight (REM), exp_avg, exp_avg_sq */
    void *g;               /* [n] gradient */
    void *out;             /* [n] new weight (out kinds 1 and 2) */
    int64_t lo, hi;        /* the block being updated */
    int flags;
    float decay, beta1, beta2, step_size, bc2_sqrt, eps, scale;
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

/* one loop, specialised for each combination of flags so that each vectorises */
static inline __attribute__((always_inline)) void run(const Job *j, const int flags) {
    const int gb = flags & G_BF16, out_kind = (flags >> OUT_SHIFT) & 3, rem = flags & REM;
    const int mb = flags & M_BF16, vb = flags & V_BF16;
    float *restrict p32 = (float *)j->p;
    int16_t *restrict r16 = (int16_t *)j->p;
    uint16_t *restrict w16 = (uint16_t *)j->w;
    float *restrict m32 = (float *)j->m, *restrict v32 = (float *)j->v;
    uint16_t *restrict m16 = (uint16_t *)j->m, *restrict v16 = (uint16_t *)j->v;
    uint16_t *restrict g16 = (uint16_t *)j->g;
    float *restrict g32 = (float *)j->g;
    uint16_t *restrict o16 = (uint16_t *)j->out;
    float *restrict o32 = (float *)j->out;
    const float decay = j->decay, b1 = j->beta1, b2 = j->beta2, c1 = 1.0f - j->beta1, c2 = 1.0f - j->beta2;
    const float step_size = j->step_size, bc2_sqrt = j->bc2_sqrt, eps = j->eps, scale = j->scale;
    for (int64_t i = j->lo; i < j->hi; i++) {
        float g = (gb ? bf16_to_f32(g16[i]) : g32[i]) / scale;
        float p = rem ? join_master(w16[i], r16[i]) : p32[i];
        float mi = b1 * (mb ? bf16_to_f32(m16[i]) : m32[i]) + c1 * g;
        float vi = b2 * (vb ? bf16_to_f32(v16[i]) : v32[i]) + c2 * g * g;
        float w = p * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
        if (rem) split_master(w, &w16[i], &r16[i]);
        else p32[i] = w;
        if (mb) m16[i] = f32_to_bf16(mi);
        else m32[i] = mi;
        if (vb) v16[i] = f32_to_bf16(vi);
        else v32[i] = vi;
        if (out_kind == 1) o32[i] = w;
        if (out_kind == 2) o16[i] = f32_to_bf16(w);
        if (out_kind == 3 && gb) g16[i] = f32_to_bf16(w); /* same element just read: no alias between i */
        if (out_kind == 3 && !gb) g32[i] = w;
    }
}

#define C1(k) case k: run(j, k); break;
#define C4(k) C1(k) C1(k + 1) C1(k + 2) C1(k + 3)
#define C16(k) C4(k) C4(k + 4) C4(k + 8) C4(k + 12)

static void range(const Job *j) {
    switch (j->flags & 63) {
    C16(0) C16(16) C16(32) C16(48)
    }
}

#define MAX_THREADS 256
#define BLOCK 65536 /* elements a thread takes at a time: 256 KiB of each fp32 state */

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
                    float beta1, float beta2, float step_size, float bc2_sqrt, float eps, float scale, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    if (threads > blocks) threads = (int)blocks;
    Shared s = {{p, w, m, v, g, out, 0, 0, flags, decay, beta1, beta2, step_size, bc2_sqrt, eps, scale}, n, 0};
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, work, &s) == 0;
    work(&s);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], NULL);
}
