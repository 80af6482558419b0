/* A fake NVIDIA driver library (libcuda.so.1), named as such: the four entry points
 * `kvstash doctor` calls, answering as one GPU under a driver for the CUDA version in
 * KVSTASH_FAKE_CUDA_DRIVER_VERSION (default 12020: CUDA 12.2, an R535 driver). cli_test puts
 * its directory on LD_LIBRARY_PATH to see how doctor words a driver older than kvstash's CUDA
 * runtime needs; nothing else loads it. */
#include <stdlib.h>

int cuInit(unsigned flags) {
  (void)flags;
  return 0;
}

int cuDeviceGetCount(int* count) {
  *count = 1;
  return 0;
}

int cuDriverGetVersion(int* version) {
  const char* v = getenv("KVSTASH_FAKE_CUDA_DRIVER_VERSION");
  *version = v != NULL ? atoi(v) : 12020;
  return 0;
}
