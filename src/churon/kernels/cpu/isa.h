// Which ISA's kernels run: each KernelTable compiled in (kernels.cpp, once per ISA) that this
// CPU can execute, and the one chosen now.
#pragma once

#include <string>
#include <vector>

#include "common.h"

namespace churon {

// ISAs compiled in and supported by this CPU, best first
std::vector<std::string> available_isas();

// switch every kernel to one ISA; std::invalid_argument when it is unknown or this CPU lacks it
void set_isa(const std::string& name);

// the kernels of the ISA chosen now
const KernelTable* kt();

// At import: the best ISA this CPU supports, then CHURON_ISA if set. A bad CHURON_ISA keeps the
// best ISA and is reported, not fatal: returns why it was not applied (empty when it was, or unset).
std::string init_isa();

}  // namespace churon
