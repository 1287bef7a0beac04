// The element-wise work of a decoder block at inference, one pass over memory each instead of the 5-12 eager
// ops (and as many temporaries) torch runs for it (infer/fused_ops.py): the RMS norm, rotary embedding of
// q and k together, and SiLU(gate) * up. fp32, CPU; the same arithmetic as models/common/elementwise.py's
// eager versions, up to the order of the norm's sum and the polynomial exponential (cpu_math.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <vector>

#include "cpu_math.h"

namespace {
constexpr int64_t kGrain = 1 << 15;  // elements per thread task: below this, threads cost more than they save

int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1)); }
}  // namespace

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat);
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.numel() == H && weight.is_contiguous());
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t N = in.numel() / std::max<int64_t>(H, 1);
  const float* xp = in.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, rows_per_task(H), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* xr = xp + n * H;
      float* o = op + n * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = wp[i] * (xr[i] * r);
    }
  });
  return out;
}

// x * cos + rotate_half(x) * sin for q [b, heads, s, d] and k [b, kv_heads, s, d] (any strides but the last),
// cos and sin [b or 1, 1, s, d]; returns new tensors laid out [b, s, heads, d] (viewed [b, heads, s, d]).
std::vector<at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                             const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 4 && sin.sizes() == cos.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && cos.stride(3) == 1 && sin.strides() == cos.strides());
  const int64_t B = q.size(0), S = q.size(2), D = q.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && k.size(0) == B && k.size(2) == S && k.size(3) == D);
  TORCH_CHECK(cos.size(1) == 1 && cos.size(2) == S && cos.size(3) == D);
  TORCH_CHECK(cos.size(0) == B || cos.size(0) == 1);
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), cs = cos.stride(2);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  std::vector<at::Tensor> outs;
  for (const at::Tensor* x : {&q, &k}) {
    const int64_t Hx = x->size(1);
    at::Tensor out = at::empty({B, S, Hx, D}, x->options());
    const float* xp = x->data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t xb = x->stride(0), xh = x->stride(1), xs = x->stride(2);
    at::parallel_for(0, B * S * Hx, rows_per_task(D), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / (S * Hx), s = row / Hx % S, h = row % Hx;
        const float* xr = xp + b * xb + h * xh + s * xs;
        const float* c = cp + b * cb + s * cs;
        const float* sn = sp + b * cb + s * cs;
        float* o = op + row * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o[i] = xr[i] * c[i] + (-xr[i + half]) * sn[i];
          o[i + half] = xr[i + half] * c[i + half] + xr[i] * sn[i + half];
        }
      }
    });
    outs.push_back(out.transpose(1, 2));
  }
  return outs;
}

// silu(gate) * up = gate / (1 + exp(-gate)) * up; gate and up of one shape (views of one gate_up output).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes());
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat);
  const int64_t I = gate.size(-1);
  const at::Tensor g = gate.reshape({-1, I}), u = up.reshape({-1, I});  // views of a gate_up split
  TORCH_CHECK(g.stride(1) == 1 && u.stride(1) == 1);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  const int64_t N = g.size(0), gs = g.stride(0), us = u.stride(0);
  const float* gp = g.data_ptr<float>();
  const float* upp = u.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, rows_per_task(I), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* gr = gp + n * gs;
      const float* ur = upp + n * us;
      float* o = op + n * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= I; i += 16) {  // the compiler leaves fast_exp's loop scalar: 16 lanes by hand
        const __m512 x = _mm512_loadu_ps(gr + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(ur + i)));
      }
#endif
      for (; i < I; ++i) o[i] = gr[i] / (1.f + fast_exp(-gr[i])) * ur[i];
    }
  });
  return out;
}
