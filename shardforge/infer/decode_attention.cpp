// Decode attention over the paged pool, every decoding sequence of a step in one call (infer/paged.py):
// out[h, r, :] = softmax(q[h, r] . K[h / G, keys of r]^T * scale) V[h / G, keys of r], for each query head h
// (G query heads share a key/value head) and each decode r, whose keys are the pool slots of its slices
// starts[i]..ends[i]-1 for i in offsets[r]..offsets[r+1]-1 (one slice when its blocks form one run; the n
// completions of a prompt read the shared prompt's run, then their own). One task per (decode, key/value
// head), over torch's intra-op threads: the G queries' scores in one pass over the keys, the softmax, then
// one pass over the values. Compiled on first use for the machine it runs on (infer/decode_kernel.py); one
// SDPA call per sequence is the fallback and the reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

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
        for (int64_t j = 0; j < n; ++j) { sg[j] = expf(sg[j] - m); t += sg[j]; }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_attention", &decode_attention); }
