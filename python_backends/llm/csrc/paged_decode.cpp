// Decode attention over the engine's paged KV cache, on CPU, in bfloat16 (AVX-512).
//
// One call attends every decoding sequence of a step for one layer: each (sequence, key/value
// head) is a task; its query heads read that head's keys and values straight from the cache
// blocks of the sequence's block table (no gathered copy, no padding to a group's longest
// context), the scores and the softmax in float32, the output rounded to bfloat16.
// Built by `python_backends/llm/cpu_attention.py`; see there for why.
#include <stdint.h>
#include <string.h>
#include <float.h>
#include <math.h>
#include <immintrin.h>
#include <vector>

static inline __m512 load_bf16(const uint16_t *p) {  // 16 bf16 -> 16 f32
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline uint16_t f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// One head's key (or value) at position t of a sequence, from its block in `head` (that head's
// cache) through the block table, as D floats; at a block's first position the next block
// of the table is prefetched.
template <int D>
static inline void load_position(const uint16_t *head, const int64_t *table, int64_t width, int64_t bs, int64_t t,
                                 __m512 *row) {
    const int64_t index = t / bs;
    if (t % bs == 0 && index + 1 < width) {
        const char *next = (const char *)(head + table[index + 1] * bs * D);
        for (int64_t c = 0; c < bs * D * 2; c += 64) _mm_prefetch(next + c, _MM_HINT_T0);
    }
    const uint16_t *at = head + (table[index] * bs + t % bs) * D;
    for (int i = 0; i < D / 16; i++) row[i] = load_bf16(at + 16 * i);
}

template <int G, int D>
static void run(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t head_stride, const int64_t *tables,
                int64_t width, const int64_t *lengths, uint16_t *out, int64_t S, int64_t KVH, int64_t bs, float scale,
                int64_t window) {
    constexpr int V = D / 16;
    const int64_t H = KVH * G;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < S * KVH; task++) {
        const int64_t s = task / KVH, h = task % KVH;
        const int64_t len = lengths[s];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        thread_local std::vector<float> scores;  // [G][len]: the scores, then the probabilities
        if ((int64_t)scores.size() < G * len) scores.resize(G * len);
        float *sc = scores.data();
        __m512 qv[G][V];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < V; i++)
                qv[g][i] = _mm512_mul_ps(load_bf16(q + (s * H + h * G + g) * D + 16 * i), _mm512_set1_ps(scale));
        const int64_t *table = tables + s * width;
        const uint16_t *kh = k + h * head_stride, *vh = v + h * head_stride;
        float mx[G];
        for (int g = 0; g < G; g++) mx[g] = -FLT_MAX;
        for (int64_t t = first; t < len; t++) {
            __m512 kv[V];
            load_position<D>(kh, table, width, bs, t, kv);
            for (int g = 0; g < G; g++) {
                __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
                for (int i = 1; i < V; i++) a = _mm512_fmadd_ps(qv[g][i], kv[i], a);
                float dot = _mm512_reduce_add_ps(a);
                sc[g * len + t] = dot;
                mx[g] = dot > mx[g] ? dot : mx[g];
            }
        }
        float inv[G];
        for (int g = 0; g < G; g++) {
            float tot = 0.f;
            float *row = sc + g * len;
            for (int64_t t = first; t < len; t++) { float p = expf(row[t] - mx[g]); row[t] = p; tot += p; }
            inv[g] = 1.f / tot;
        }
        __m512 acc[G][V];
        for (int g = 0; g < G; g++) for (int i = 0; i < V; i++) acc[g][i] = _mm512_setzero_ps();
        for (int64_t t = first; t < len; t++) {
            __m512 vv[V];
            load_position<D>(vh, table, width, bs, t, vv);
            for (int g = 0; g < G; g++) {
                __m512 p = _mm512_set1_ps(sc[g * len + t]);
                for (int i = 0; i < V; i++) acc[g][i] = _mm512_fmadd_ps(p, vv[i], acc[g][i]);
            }
        }
        for (int g = 0; g < G; g++) {
            uint16_t *o = out + (s * H + h * G + g) * D;
            float buf[D];
            for (int i = 0; i < V; i++) _mm512_storeu_ps(buf + 16 * i, _mm512_mul_ps(acc[g][i], _mm512_set1_ps(inv[g])));
            for (int d = 0; d < D; d++) o[d] = f2bf(buf[d]);
        }
    }
}

extern "C" int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t head_stride,
                                     const int64_t *tables, int64_t width, const int64_t *lengths, uint16_t *out,
                                     int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale,
                                     int64_t window) {
    const int64_t G = H / KVH;
#define CASE(g, d) if (G == g && D == d) { run<g, d>(q, k, v, head_stride, tables, width, lengths, out, S, KVH, bs, scale, window); return 0; }
    CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(1, 128) CASE(2, 128) CASE(4, 128) CASE(8, 128)
    return -1;
}
