#include "common/runtime_library.h"

#include <dlfcn.h>

namespace kvstash::sys {

RuntimeLibrary::RuntimeLibrary(std::initializer_list<const char*> sonames, std::string install_hint) {
  std::string tried;
  std::string last;
  for (const char* soname : sonames) {
    handle_ = ::dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (handle_ != nullptr) return;
    if (const char* why = ::dlerror(); why != nullptr) last = why;
    tried += tried.empty() ? soname : std::string(", ") + soname;
  }
  error_ = "cannot load " + tried + (last.empty() ? "" : " (" + last + ")") + ": " + install_hint;
}

void* RuntimeLibrary::symbol(const char* name) const {
  return handle_ != nullptr ? ::dlsym(handle_, name) : nullptr;
}

}  // namespace kvstash::sys
