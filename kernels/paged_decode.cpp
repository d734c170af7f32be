// A decode step's attention on CPU, read in place: each sequence's query heads over the K/V rows listed
// for it, with no gathered copy and no padding (kernels/paged_decode.py documents the contract).
//
// One pass per sequence in blocks of KEY_BLOCK keys: the block's logits for every query head, then an
// online softmax (running max and sum), then its values. Everything is accumulated in fp32 and the output
// is rounded to the input dtype once, as ATen's CPU SDPA does for bf16. Built with -ffast-math so that the
// exp loop is vectorized (glibc's libmvec): the kernel never relies on infinities (its running max starts
// at -FLT_MAX), and reassociation only changes the fp32 summation order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t KEY_BLOCK = 64;  // keys whose probabilities are held at once, per query head
constexpr int LANES = 16;          // independent partial sums of a dot product (one AVX-512 fp32 register)

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  // A bf16 is the high half of an fp32: a shift, which vectorizes (c10's scalar conversion does not).
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float part[LANES] = {0.f};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES)
    for (int i = 0; i < LANES; ++i) part[i] += a[d + i] * b[d + i];
  float sum = 0.f;
  for (; d < n; ++d) sum += a[d] * b[d];
  for (int i = 0; i < LANES; ++i) sum += part[i];
  return sum;
}

template <typename scalar_t>
void paged_decode_kernel(const scalar_t* q, const scalar_t* k, const scalar_t* v, const int64_t* rows,
                         const int64_t* ends, scalar_t* out, int64_t sequences, int64_t group, int64_t dim,
                         int64_t dim_v, int64_t width, int64_t k_stride, int64_t v_stride, float scale) {
  at::parallel_for(0, sequences, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * dim), acc(group * dim_v), probs(group * KEY_BLOCK), key(dim), value(dim_v);
    std::vector<float> running_max(group), running_sum(group);
    for (int64_t s = begin; s < end; ++s) {
      to_float(q + s * group * dim, queries.data(), group * dim);
      for (auto& x : queries) x *= scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(running_max.begin(), running_max.end(), -FLT_MAX);
      std::fill(running_sum.begin(), running_sum.end(), 0.f);
      const int64_t* sequence_rows = rows + s * width;
      const int64_t keys = ends[s];
      for (int64_t first = 0; first < keys; first += KEY_BLOCK) {
        const int64_t count = std::min(KEY_BLOCK, keys - first);
        for (int64_t j = 0; j < count; ++j) {
          to_float(k + sequence_rows[first + j] * k_stride, key.data(), dim);
          for (int64_t g = 0; g < group; ++g) probs[g * KEY_BLOCK + j] = dot(queries.data() + g * dim, key.data(), dim);
        }
        for (int64_t g = 0; g < group; ++g) {
          float* p = probs.data() + g * KEY_BLOCK;
          const float new_max = std::max(running_max[g], *std::max_element(p, p + count));
          const float rescale = std::exp(running_max[g] - new_max);
          float sum = 0.f;
          for (int64_t j = 0; j < count; ++j) {
            p[j] = std::exp(p[j] - new_max);
            sum += p[j];
          }
          running_sum[g] = running_sum[g] * rescale + sum;
          running_max[g] = new_max;
          float* a = acc.data() + g * dim_v;
          for (int64_t d = 0; d < dim_v; ++d) a[d] *= rescale;
        }
        for (int64_t j = 0; j < count; ++j) {
          to_float(v + sequence_rows[first + j] * v_stride, value.data(), dim_v);
          for (int64_t g = 0; g < group; ++g) {
            const float weight = probs[g * KEY_BLOCK + j];
            float* a = acc.data() + g * dim_v;
            for (int64_t d = 0; d < dim_v; ++d) a[d] += weight * value[d];
          }
        }
      }
      scalar_t* o = out + s * group * dim_v;
      for (int64_t g = 0; g < group; ++g) {
        const float inverse = running_sum[g] > 0.f ? 1.f / running_sum[g] : 0.f;  // no keys: 0
        for (int64_t d = 0; d < dim_v; ++d) o[g * dim_v + d] = static_cast<scalar_t>(acc[g * dim_v + d] * inverse);
      }
    }
  });
}

template <typename scalar_t>
void launch(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows, const at::Tensor& rows,
            const at::Tensor& ends, at::Tensor& out, double scale) {
  paged_decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_rows.data_ptr<scalar_t>(), v_rows.data_ptr<scalar_t>(),
                                rows.data_ptr<int64_t>(), ends.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0),
                                q.size(1), q.size(2), v_rows.size(1), rows.size(1), k_rows.stride(0), v_rows.stride(0),
                                static_cast<float>(scale));
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows, const at::Tensor& rows,
                        const at::Tensor& ends, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [S, G, D] tensor");
  TORCH_CHECK(k_rows.dim() == 2 && v_rows.dim() == 2 && k_rows.stride(1) == 1 && v_rows.stride(1) == 1,
              "k_rows / v_rows must be [rows, D] with unit inner stride");
  TORCH_CHECK(k_rows.size(1) == q.size(2), "k_rows and q differ in head dim");
  TORCH_CHECK(k_rows.scalar_type() == q.scalar_type() && v_rows.scalar_type() == q.scalar_type(),
              "q, k_rows and v_rows must share one dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.is_contiguous() && rows.size(0) == q.size(0),
              "rows must be a contiguous int64 [S, W] tensor");
  TORCH_CHECK(ends.scalar_type() == at::kLong && ends.dim() == 1 && ends.is_contiguous() && ends.size(0) == q.size(0),
              "ends must be a contiguous int64 [S] tensor");
  auto out = q.new_empty({q.size(0), q.size(1), v_rows.size(1)});
  switch (q.scalar_type()) {
    case at::kFloat: launch<float>(q, k_rows, v_rows, rows, ends, out, scale); break;
    case at::kBFloat16: launch<c10::BFloat16>(q, k_rows, v_rows, rows, ends, out, scale); break;
    case at::kHalf: launch<c10::Half>(q, k_rows, v_rows, rows, ends, out, scale); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}

TORCH_LIBRARY(sgl_kvevict, m) {
  m.def("paged_decode(Tensor q, Tensor k_rows, Tensor v_rows, Tensor rows, Tensor ends, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kvevict, CPU, m) { m.impl("paged_decode", &paged_decode); }
