// Paged attention for single-query rows on the CPU, reading K/V where they lie in the page pool.
//
// The pure-torch path must first gather each sequence's pages into one tensor (a copy of every cached K/V byte,
// written and read again) before a batched matmul can use them; at decode, where reading the cache is most of
// attention's cost, that triples the traffic. This kernel walks each sequence's block table instead and reads
// each cached key and value once, for all the query heads that share its KV head.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// Pages are scattered in the pool, so the hardware prefetcher cannot see the next one coming: while reading a
// token's row, ask for the row a few tokens ahead (on the next page, near a page's end), so it arrives in time.
constexpr int64_t kPrefetchTokens = 8;

template <typename scalar_t>
inline void prefetch_ahead(const scalar_t* data, const int64_t* table, int64_t t, int64_t context,
                           int64_t page_size, int64_t page_stride, int64_t row_elements, int64_t token_stride) {
  const int64_t ahead = t + kPrefetchTokens;
  if (ahead >= context) return;
  const char* row = reinterpret_cast<const char*>(data + table[ahead / page_size] * page_stride +
                                                  (ahead % page_size) * token_stride);
  const int64_t bytes = row_elements * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset);
}

// One work item: one sequence's query heads [first_kv_head, last_kv_head) times their groups. Each of its cached
// tokens is read as one contiguous row of every KV head the item covers (a page is one contiguous block), so a
// whole-sequence item streams its pages front to back; a sequence is split by KV heads only when there are fewer
// sequences than threads (batch 1), so that every core has work.
template <typename scalar_t>
void attend_item(const scalar_t* q, const scalar_t* k_data, const scalar_t* v_data, const int64_t* table,
                 int64_t context, int64_t first_kv_head, int64_t last_kv_head, int64_t group, int64_t head_dim,
                 int64_t page_size, int64_t token_stride, float scale, scalar_t* out, std::vector<float>& query,
                 std::vector<float>& acc, std::vector<float>& scores) {
  const int64_t first_head = first_kv_head * group, num_heads = (last_kv_head - first_kv_head) * group;
  const int64_t page_stride = page_size * token_stride;
  const int64_t row_elements = (last_kv_head - first_kv_head) * head_dim;  // what the item reads of each token
  query.resize(num_heads * head_dim);
  acc.assign(num_heads * head_dim, 0.f);
  scores.resize(num_heads * context);
  for (int64_t i = 0; i < num_heads * head_dim; ++i)
    query[i] = static_cast<float>(q[first_head * head_dim + i]) * scale;
  // Scores: each cached key is read once, for every query head of its group.
  for (int64_t t = 0; t < context; ++t) {
    const scalar_t* row = k_data + table[t / page_size] * page_stride + (t % page_size) * token_stride;
    prefetch_ahead(k_data + first_kv_head * head_dim, table, t, context, page_size, page_stride, row_elements,
                   token_stride);
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* qh = query.data() + h * head_dim;
      const scalar_t* key = row + (first_kv_head + h / group) * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * static_cast<float>(key[d]);
      scores[h * context + t] = dot;
    }
  }
  // Softmax per query head, in float32.
  for (int64_t h = 0; h < num_heads; ++h) {
    float* weights = scores.data() + h * context;
    const float top = *std::max_element(weights, weights + context);
    float total = 0.f;
    for (int64_t t = 0; t < context; ++t) total += (weights[t] = std::exp(weights[t] - top));
    const float inverse = 1.f / total;
    for (int64_t t = 0; t < context; ++t) weights[t] *= inverse;
  }
  // Weighted values: each cached value is read once too.
  for (int64_t t = 0; t < context; ++t) {
    const scalar_t* row = v_data + table[t / page_size] * page_stride + (t % page_size) * token_stride;
    prefetch_ahead(v_data + first_kv_head * head_dim, table, t, context, page_size, page_stride, row_elements,
                   token_stride);
    for (int64_t h = 0; h < num_heads; ++h) {
      const float p = scores[h * context + t];
      const scalar_t* value = row + (first_kv_head + h / group) * head_dim;
      float* ah = acc.data() + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * static_cast<float>(value[d]);
    }
  }
  for (int64_t i = 0; i < num_heads * head_dim; ++i) out[first_head * head_dim + i] = static_cast<scalar_t>(acc[i]);
}

template <typename scalar_t>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                   const at::Tensor& block_table, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t page_size = k_pages.size(1), num_kv_heads = k_pages.size(2);
  const int64_t group = num_heads / num_kv_heads, max_pages = block_table.size(1);
  // Under this many cached tokens in all (a short batch reads well under a megabyte) waking the other threads
  // costs more than it saves: the whole call runs on this one, each sequence as one item.
  constexpr int64_t kParallelTokens = 4096;
  const bool serial = num_seqs * max_pages * page_size < kParallelTokens;
  const int64_t splits = serial || num_seqs >= at::get_num_threads() ? 1 : num_kv_heads;  // items per sequence
  const int64_t grain = serial ? num_seqs : 1;
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const int64_t q_token_stride = q.stride(0);  // queries may be a view into the rows of a wider projection
  const scalar_t* k_data = k_pages.data_ptr<scalar_t>();
  const scalar_t* v_data = v_pages.data_ptr<scalar_t>();
  const int64_t* tables = block_table.data_ptr<int64_t>();
  const int64_t* lengths = context_lens.data_ptr<int64_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  at::parallel_for(0, num_seqs * splits, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> query, acc, scores;  // per thread, reused across its items
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / splits, part = item % splits;
      const int64_t first = part * num_kv_heads / splits, last = (part + 1) * num_kv_heads / splits;
      attend_item<scalar_t>(q_data + seq * q_token_stride, k_data, v_data, tables + seq * max_pages,
                            lengths[seq], first, last, group, head_dim, page_size, num_kv_heads * head_dim,
                            static_cast<float>(scale), out_data + seq * num_heads * head_dim, query, acc, scores);
    }
  });
}

}  // namespace

// q: [num_seqs, num_heads, head_dim] (each row's heads contiguous); k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim];
// block_table: [num_seqs, max_pages] int64; context_lens: [num_seqs] int64. Returns [num_seqs, num_heads, head_dim].
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                        const at::Tensor& block_table, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_decode: each query row's heads back to back");
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous(), "paged_decode: contiguous page pools");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "paged_decode: int64");
  at::Tensor block_table_c = block_table.contiguous(), lengths_c = context_lens.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q, k_pages, v_pages, block_table_c, lengths_c, scale, out);
  });
  return out;
}

// Registered as an operator, torch.ops.tokend.paged_decode: it shows in the profiler under that name.
TORCH_LIBRARY(tokend, m) {
  m.def("paged_decode(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor context_lens, float scale) "
        "-> Tensor",
        &paged_decode);
}
