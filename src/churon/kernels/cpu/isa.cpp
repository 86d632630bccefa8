// Runtime ISA choice among the KernelTables compiled in (see isa.h).

#include "isa.h"

#include <cstdlib>
#include <stdexcept>

#if defined(CHURON_HAVE_AMX)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace churon {
namespace {

struct IsaEntry {
  const char* name;
  const KernelTable* (*table)();
  bool (*supported)();
};

#if (defined(__x86_64__) || defined(__i386__)) && (defined(CHURON_HAVE_AVX2) || defined(CHURON_HAVE_AVX512))
bool cpu_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool cpu_avx512() {
  __builtin_cpu_init();
  return cpu_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}
#endif
#if defined(CHURON_HAVE_AMX)
// AMX-INT8 and its tiles (CPUID 7.0 EDX bits 24, 25), enabled by the OS (XCR0 bits 17, 18: tile
// configuration and data) and offered by Linux (ARCH_GET_XCOMP_SUPP). Permission to use the tiles is
// not asked here: the AMX kernel asks for it (ARCH_REQ_XCOMP_PERM) in the thread about to use them,
// so a process that never runs it never holds it.
bool cpu_amx() {
  if (!cpu_avx512()) return false;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE: xgetbv exists
  unsigned lo, hi;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3) != 3) return false;
  unsigned long long features = 0;
  if (syscall(SYS_arch_prctl, 0x1021 /* ARCH_GET_XCOMP_SUPP */, &features) != 0) return false;
  return (features >> 18) & 1;  // XTILEDATA
}
#endif
bool cpu_any() { return true; }

const std::vector<IsaEntry>& all_isas() {  // best first
  static const std::vector<IsaEntry> v = {
#if defined(CHURON_HAVE_AMX)
      {"amx", amx::table, cpu_amx},
#endif
#if defined(CHURON_HAVE_AVX512)
      {"avx512", avx512::table, cpu_avx512},
#endif
#if defined(CHURON_HAVE_AVX2)
      {"avx2", avx2::table, cpu_avx2},
#endif
      {"scalar", scalar::table, cpu_any},
  };
  return v;
}

const KernelTable* g_kt = nullptr;
bool g_prefetch_ahead = false;

bool cpu_intel() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}

}  // namespace

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (const auto& e : all_isas())
    if (e.supported()) out.push_back(e.name);
  return out;
}

void set_isa(const std::string& name) {
  for (const auto& e : all_isas()) {
    if (name == e.name) {
      if (!e.supported())
        throw std::invalid_argument("ISA '" + name + "' is not supported by this CPU");
      g_kt = e.table();
      return;
    }
  }
  std::string names;
  for (const auto& n : available_isas()) names += (names.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown ISA '" + name + "' (available: " + names + ")");
}

const KernelTable* kt() { return g_kt; }

bool prefetch_weights_ahead() { return g_prefetch_ahead; }

const KernelTable* bf16_tiles() {
#if defined(CHURON_HAVE_AMX)
  if (!g_kt || !g_kt->gemm_bf16_tiles || std::string(g_kt->name) != "amx") return nullptr;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1)) return nullptr;  // AMX-BF16
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return nullptr;   // AVX512-BF16
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return nullptr;
  return g_kt;
#else
  return nullptr;
#endif
}

std::string init_isa() {
  g_prefetch_ahead = cpu_intel();
  for (const auto& e : all_isas()) {
    if (e.supported()) {
      g_kt = e.table();
      break;
    }
  }
  const char* env = std::getenv("CHURON_ISA");
  if (!env || !*env) return "";
  try {
    set_isa(env);
  } catch (const std::exception& e) {
    return std::string("CHURON_ISA=") + env + ": " + e.what();
  }
  return "";
}

}  // namespace churon
