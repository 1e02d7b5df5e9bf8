/* AdamW over one slice of a host chunk in one pass over memory.
 *
 * Reads the gradient (bf16, or fp32 where micro batches add up in fp32), updates the fp32 master weight
 * and moments in place, and writes the new weight in the model's dtype (bf16 or fp32: into a buffer of
 * its own, over the gradient it was computed from when that has the weight's dtype, or not at all):
 * 28 bytes per parameter for a bf16 gradient and weight (30 for an fp32 gradient), where converting
 * the gradient up, running fp32 AdamW and converting the weight back moves 40 in three passes.
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

typedef struct {
    float *p, *m, *v;      /* [n] fp32 master weight, exp_avg, exp_avg_sq */
    void *g;               /* [n] gradient: bf16 when bf16, else fp32 */
    void *out;             /* [n] new weight: out (out_kind 1), over g (2, g's dtype), none (0) */
    int64_t lo, hi;        /* the block being updated */
    int bf16, out_kind, out_bf16; /* bf16: the gradient is bf16; out_bf16: the weight written is bf16 */
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

/* one loop, specialised for each (gradient dtype, output, output dtype) so that each vectorises */
static inline __attribute__((always_inline)) void run(const Job *j, const int bf16, const int out_kind,
                                                      const int out_bf16) {
    float *restrict p = j->p, *restrict m = j->m, *restrict v = j->v;
    uint16_t *restrict g16 = (uint16_t *)j->g;
    float *restrict g32 = (float *)j->g;
    uint16_t *restrict o16 = (uint16_t *)j->out;
    float *restrict o32 = (float *)j->out;
    const float decay = j->decay, b1 = j->beta1, b2 = j->beta2, c1 = 1.0f - j->beta1, c2 = 1.0f - j->beta2;
    const float step_size = j->step_size, bc2_sqrt = j->bc2_sqrt, eps = j->eps, scale = j->scale;
    for (int64_t i = j->lo; i < j->hi; i++) {
        float g = (bf16 ? bf16_to_f32(g16[i]) : g32[i]) / scale;
        float mi = b1 * m[i] + c1 * g;
        float vi = b2 * v[i] + c2 * g * g;
        float w = p[i] * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
        p[i] = w;
        m[i] = mi;
        v[i] = vi;
        if (out_kind == 1 && out_bf16) o16[i] = f32_to_bf16(w);
        if (out_kind == 1 && !out_bf16) o32[i] = w;
        if (out_kind == 2 && bf16) g16[i] = f32_to_bf16(w); /* same element just read: no alias between i */
        if (out_kind == 2 && !bf16) g32[i] = w;
    }
}

static void range(const Job *j) {
    switch (j->bf16 * 4 + (j->out_kind == 1 ? 1 + j->out_bf16 : j->out_kind == 2 ? 3 : 0)) {
    case 0: run(j, 0, 0, 0); break;
    case 1: run(j, 0, 1, 0); break; /* fp32 gradient, fp32 weight */
    case 2: run(j, 0, 1, 1); break; /* fp32 gradient (added up in fp32), bf16 weight */
    case 3: run(j, 0, 2, 0); break;
    case 4: run(j, 1, 0, 0); break;
    case 5: run(j, 1, 1, 0); break;
    case 6: run(j, 1, 1, 1); break;
    default: run(j, 1, 2, 1); break;
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
void angelgpt_adamw(float *p, float *m, float *v, void *g, int bf16, void *out, int out_kind, int out_bf16, int64_t n,
                    float decay, float beta1, float beta2, float step_size, float bc2_sqrt, float eps, float scale,
                    int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    if (threads > blocks) threads = (int)blocks;
    Shared s = {{p, m, v, g, out, 0, 0, bf16, out_kind, out_bf16, decay, beta1, beta2, step_size, bc2_sqrt, eps, scale},
                n, 0};
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, work, &s) == 0;
    work(&s);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], NULL);
}
