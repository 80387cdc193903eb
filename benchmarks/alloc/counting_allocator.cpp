// The memory referee for benchmarks/: counts the requested bytes of every live CPU storage.
//
// Installed over c10's CPU allocator (c10::SetCPUAllocator), so it sees every storage PyTorch
// allocates on the CPU afterwards, on any thread: parameters, gradients, optimizer state,
// autograd's saved tensors, our buffers, and the collective backend's own staging tensors.
// A C ABI for ctypes; built by alloc/__init__.py with g++ on first use.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace {

std::atomic<int64_t> live{0};
std::atomic<int64_t> high{0};
std::mutex sizes_mu;
std::unordered_map<void*, size_t>* sizes = nullptr;  // never freed: storages may die at exit
c10::Allocator* wrapped = nullptr;

void release(void* ptr) {
  if (ptr == nullptr) return;
  size_t n = 0;
  {
    std::lock_guard<std::mutex> g(sizes_mu);
    auto it = sizes->find(ptr);
    if (it != sizes->end()) {
      n = it->second;
      sizes->erase(it);
    }
  }
  live.fetch_sub(static_cast<int64_t>(n));
  wrapped->raw_deallocate(ptr);
}

struct Counting final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* p = wrapped->raw_allocate(nbytes);
    if (p != nullptr && nbytes > 0) {
      {
        std::lock_guard<std::mutex> g(sizes_mu);
        (*sizes)[p] = nbytes;
      }
      int64_t now = live.fetch_add(static_cast<int64_t>(nbytes)) + static_cast<int64_t>(nbytes);
      int64_t seen = high.load();
      while (now > seen && !high.compare_exchange_weak(seen, now)) {
      }
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

extern "C" {
int counting_install() {
  static Counting* self = nullptr;
  if (self != nullptr) return 1;
  wrapped = c10::GetCPUAllocator();
  if (wrapped->raw_deleter() == nullptr) return -1;  // its pointers cannot be freed raw
  sizes = new std::unordered_map<void*, size_t>();
  self = new Counting();
  c10::SetCPUAllocator(self, /*priority=*/100);
  return c10::GetCPUAllocator() == self ? 1 : -2;
}
int64_t counting_live() { return live.load(); }
int64_t counting_peak() { return high.load(); }
void counting_reset_peak() { high.store(live.load()); }
}
