// A shared library opened at run time (dlopen), for the optional transports' own libraries:
// rdma-core's libibverbs and UCX's libucp are not linked, so that one build (a wheel among them)
// runs on hosts that have neither, where those transports say they are unavailable instead of
// the whole library failing to load.
#pragma once

#include <initializer_list>
#include <string>

namespace kvstash::sys {

class RuntimeLibrary {
 public:
  // Opens the first of `sonames` the dynamic loader finds (RTLD_NOW | RTLD_LOCAL), now; never
  // closed (the library's threads and registered memory may outlive any owner of this object).
  RuntimeLibrary(std::initializer_list<const char*> sonames, std::string install_hint);
  RuntimeLibrary(const RuntimeLibrary&) = delete;
  RuntimeLibrary& operator=(const RuntimeLibrary&) = delete;

  bool available() const { return handle_ != nullptr; }
  // Why it is not available: the sonames tried, the loader's last message and what to install.
  // Empty when it is.
  const std::string& error() const { return error_; }
  // The address of `name` in the library or its dependencies (UCX's ucs_* are libucs's), or
  // nullptr when the library is unavailable or lacks it.
  void* symbol(const char* name) const;
  // symbol() as a function of type `Fn` (a pointer to function), or nullptr.
  template <typename Fn>
  Fn function(const char* name) const {
    return reinterpret_cast<Fn>(symbol(name));
  }

 private:
  void* handle_ = nullptr;
  std::string error_;
};

}  // namespace kvstash::sys
