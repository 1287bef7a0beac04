// Decode attention over the paged pool, every decoding sequence of a step in one call (infer/paged.py):
// out[h, r, :] = softmax(q[h, r] . K[h / G, keys of r]^T * scale) V[h / G, keys of r], for each query head h
// (G query heads share a key/value head) and each decode r, whose keys are the pool slots of its slices
// starts[i]..ends[i]-1 for i in offsets[r]..offsets[r+1]-1 (one slice when its blocks form one run; the n
// completions of a prompt read the shared prompt's run, then their own). One task per (decode, key/value
// head), over torch's intra-op threads: the G queries' scores in one pass over the keys, the softmax, then
// one pass over the values. The keys and values stream from memory once per step (a 64-request burst's
// pool is larger than the cache), so the kernel is as fast as it keeps that stream going: with AVX-512 (and
// a head_dim of 16, 32, 64 or 128) the scores of sixteen keys come from one tree of adds instead of sixteen
// horizontal sums, the exponentials are computed sixteen at a time, and the values are prefetched while the
// scores are made (measured here, 64 decodes of 300 keys, SmolLM2-135M's heads, 30 layers: 53 -> 38 ms,
// against 31 ms to merely read the keys and values; on the 64-request chat job, steps alternating between
// the kernels, 1.56 -> 1.02 s). Compiled on first use for the machine it runs on (infer/cpu_kernels.py);
// one SDPA call per sequence is the fallback and the reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <vector>

#include "cpu_math.h"

#if defined(__AVX512F__)
// Sixteen vectors -> one whose lane j is the sum of vector j's lanes (a transposing tree of adds).
static inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// The lanes of block `blk` of sixteen keys that hold one of the n keys (the last block may be partial).
static inline __mmask16 held(int64_t n, int64_t blk) {
  return static_cast<__mmask16>((1u << std::min<int64_t>(16, n - blk * 16)) - 1);
}

// One (decode, key/value head) task with head_dim = 16 C: scores sixteen keys at a time, the softmax, then
// the values: `rows[j]` is where the task's j-th key (and value) starts in its head's part of the pool,
// `qs[g]` and `outs[g]` the g-th query head's query and output.
template <int C>
static void task16(const float* const* qs, int64_t G, const float* kp, const float* vp, const int64_t* rows,
                   int64_t n, float sc, float* scores, float* const* outs) {
  const int64_t blocks = (n + 15) / 16;
  for (int64_t g = 0; g < G; ++g) {
    __m512 q[C];
    for (int c = 0; c < C; ++c) q[c] = _mm512_mul_ps(_mm512_loadu_ps(qs[g] + 16 * c), _mm512_set1_ps(sc));
    float* sg = scores + g * blocks * 16;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t key = std::min<int64_t>(blk * 16 + j, n - 1);
        const float* k = kp + rows[key];
        if (g == 0)  // the values' rows on their way to the cache while the scores are made
          for (int c = 0; c < C; ++c)
            _mm_prefetch(reinterpret_cast<const char*>(vp + rows[key] + 16 * c), _MM_HINT_T1);
        __m512 s = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
        for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + 16 * c), s);
        acc[j] = s;
      }
      const __m512 s = sum16(acc);
      _mm512_storeu_ps(sg + blk * 16, s);
      mx = _mm512_mask_max_ps(mx, held(n, blk), mx, s);
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 total = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sg + blk * 16), m);
      const __m512 e = _mm512_maskz_mov_ps(held(n, blk), exp16(x));
      _mm512_storeu_ps(sg + blk * 16, e);
      total = _mm512_add_ps(total, e);
    }
    const float inv = 1.f / _mm512_reduce_add_ps(total);
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  const int64_t stride = blocks * 16;
  for (int64_t g = 0; g < G; g += 4) {  // four query heads' accumulators at a time: 4 C registers
    const int64_t gs = std::min<int64_t>(4, G - g);
    __m512 acc[4][C];
    for (int h = 0; h < 4; ++h)
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* v = vp + rows[j];
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
      for (int h = 0; h < gs; ++h) {
        const __m512 p = _mm512_set1_ps(scores[(g + h) * stride + j]);
        for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(p, vv[c], acc[h][c]);
      }
    }
    for (int h = 0; h < gs; ++h)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(outs[g + h] + 16 * c, acc[h][c]);
  }
}
#endif

void decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                      const at::Tensor& starts, const at::Tensor& ends, const at::Tensor& offsets,
                      at::Tensor& out, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3 && out.dim() == 3);
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat);
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && q.stride(2) == 1 && out.stride(2) == 1);
  TORCH_CHECK(q.size(0) % keys.size(0) == 0);
  TORCH_CHECK(offsets.size(0) == q.size(1) + 1);
  const int64_t R = q.size(1), D = q.size(2);
  const int64_t KV = keys.size(0), S = keys.size(1);
  const int64_t G = q.size(0) / KV;
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* a = starts.data_ptr<int64_t>();
  const int64_t* b = ends.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const float sc = static_cast<float>(scale);
#if defined(__AVX512F__)
  if (D == 16 || D == 32 || D == 64 || D == 128) {
    at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<int64_t> rows;
      std::vector<const float*> qs(G);
      std::vector<float*> outs(G);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / KV, kv = task % KV;
        rows.clear();
        for (int64_t i = off[r]; i < off[r + 1]; ++i)
          for (int64_t slot = a[i]; slot < b[i]; ++slot) rows.push_back(slot * D);
        const int64_t n = static_cast<int64_t>(rows.size());
        scores.resize(G * ((n + 15) / 16) * 16);
        for (int64_t g = 0; g < G; ++g) {
          qs[g] = qp + (kv * G + g) * qs0 + r * qs1;
          outs[g] = op + (kv * G + g) * os0 + r * os1;
        }
        const float* kb = kp + kv * S * D;
        const float* vb = vp + kv * S * D;
        switch (D / 16) {
          case 1: task16<1>(qs.data(), G, kb, vb, rows.data(), n, sc, scores.data(), outs.data()); break;
          case 2: task16<2>(qs.data(), G, kb, vb, rows.data(), n, sc, scores.data(), outs.data()); break;
          case 4: task16<4>(qs.data(), G, kb, vb, rows.data(), n, sc, scores.data(), outs.data()); break;
          case 8: task16<8>(qs.data(), G, kb, vb, rows.data(), n, sc, scores.data(), outs.data()); break;
          default: TORCH_CHECK(false, "head_dim ", D);
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D), mx(G), sum(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / KV, kv = task % KV;
      int64_t n = 0;
      for (int64_t i = off[r]; i < off[r + 1]; ++i) n += b[i] - a[i];
      scores.resize(G * n);
      for (int64_t g = 0; g < G; ++g) mx[g] = -INFINITY;
      int64_t at = 0;
      for (int64_t i = off[r]; i < off[r + 1]; ++i) {
        for (int64_t slot = a[i]; slot < b[i]; ++slot, ++at) {
          const float* k = kp + (kv * S + slot) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qq = qp + (kv * G + g) * qs0 + r * qs1;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qq[d] * k[d];
            s *= sc;
            scores[g * n + at] = s;
            mx[g] = std::max(mx[g], s);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float t = 0.f;
        float* sg = scores.data() + g * n;
        const float m = mx[g];
#pragma omp simd reduction(+ : t)
        for (int64_t j = 0; j < n; ++j) { sg[j] = fast_exp(sg[j] - m); t += sg[j]; }
        sum[g] = t;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      at = 0;
      for (int64_t i = off[r]; i < off[r + 1]; ++i) {
        for (int64_t slot = a[i]; slot < b[i]; ++slot, ++at) {
          const float* v = vp + (kv * S + slot) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * n + at];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (kv * G + g) * os0 + r * os1;
        const float inv = 1.f / sum[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
}
