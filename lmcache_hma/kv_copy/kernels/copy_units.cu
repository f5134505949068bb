// Batched copy of equal-size pieces ("units") of memory, all in one launch.
//
// Unit u is copied from src[u] to dst[u], unit_bytes bytes, as opaque bytes.
// Either side may be pinned host memory addressed through UVA (zero-copy: the
// kernel itself reads or writes host memory over the bus) or device memory.
//
// Launch shape: one CTA per unit, grid-stride over units; the threads of a CTA
// stride over the words of their unit, UNROLL words in flight per thread (loads
// first, then stores) so that many reads of host memory are outstanding.
// The host picks the widest word W in {16, 8, 4, 2, 1} bytes dividing every
// address and unit_bytes, and launches copy_units_<W>.
// Compiled by NVRTC (CuPy RawModule) or nvcc; no headers needed.

namespace {

constexpr unsigned UNROLL = 4;

template <typename Word>
__device__ __forceinline__ void copy_units(const unsigned long long* __restrict__ src,
                                           const unsigned long long* __restrict__ dst,
                                           unsigned long long n_units,
                                           unsigned long long unit_bytes) {
  const unsigned long long n_words = unit_bytes / sizeof(Word);
  const unsigned long long step = blockDim.x;
  for (unsigned long long u = blockIdx.x; u < n_units; u += gridDim.x) {
    const Word* __restrict__ s = reinterpret_cast<const Word*>(src[u]);
    Word* __restrict__ d = reinterpret_cast<Word*>(dst[u]);
    unsigned long long i = threadIdx.x;
    for (; i + (UNROLL - 1) * step < n_words; i += UNROLL * step) {
      Word w[UNROLL];
#pragma unroll
      for (unsigned k = 0; k < UNROLL; ++k) w[k] = s[i + k * step];
#pragma unroll
      for (unsigned k = 0; k < UNROLL; ++k) d[i + k * step] = w[k];
    }
    for (; i < n_words; i += step) d[i] = s[i];
  }
}

}  // namespace

#define COPY_UNITS_KERNEL(WIDTH, WORD)                                              \
  extern "C" __global__ void copy_units_##WIDTH(                                    \
      const unsigned long long* __restrict__ src,                                   \
      const unsigned long long* __restrict__ dst, unsigned long long n_units,       \
      unsigned long long unit_bytes) {                                              \
    copy_units<WORD>(src, dst, n_units, unit_bytes);                                \
  }

COPY_UNITS_KERNEL(16, uint4)
COPY_UNITS_KERNEL(8, unsigned long long)
COPY_UNITS_KERNEL(4, unsigned int)
COPY_UNITS_KERNEL(2, unsigned short)
COPY_UNITS_KERNEL(1, unsigned char)
