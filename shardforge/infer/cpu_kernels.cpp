// The CPU kernels of inference as one Python module (infer/cpu_kernels.py builds it): decode attention over
// the paged pool (decode_attention.cpp) and a block's fused element-wise ops (elementwise.cpp).
#include <torch/extension.h>

void decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                      const at::Tensor& starts, const at::Tensor& ends, const at::Tensor& offsets,
                      at::Tensor& out, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                             const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention);
  m.def("rms_norm", &rms_norm);
  m.def("rope", &rope);
  m.def("silu_mul", &silu_mul);
}
