// Keeps libmhc_host.so loadable down to glibc 2.28 (torch's own floor, manylinux_2_28) when it is
// built on a newer glibc.
//
// libstdc++ is linked statically (GLIBCXX_3.4.26+ is newer than the floor's libstdc++), which
// brings in what the build host's libstdc++.a references. glibc 2.34 moved dlopen, dlsym and
// pthread_once into libc under new versions (GLIBC_2.34); the linker renames every reference to
// them, ours and the archive's, to the wrappers below (-Wl,--wrap=...), which call the versions
// every glibc since 2.2.5 provides (x86-64's base version; the library is built for x86-64).
// __libc_single_threaded (GLIBC_2.32) is only a hint that lets libstdc++ skip atomic reference
// counting in a single-threaded process: our own copy, always 0, keeps the atomics, which is
// correct in every process.

#include <dlfcn.h>
#include <pthread.h>

#define MHC_HIDDEN __attribute__((visibility("hidden")))

extern "C" {

MHC_HIDDEN char __libc_single_threaded = 0;

#if defined(__x86_64__) && defined(__GLIBC__)
void* mhc_dlopen_base(const char* file, int mode);
void* mhc_dlsym_base(void* handle, const char* name);
int mhc_pthread_once_base(pthread_once_t* once, void (*init)());
__asm__(".symver mhc_dlopen_base, dlopen@GLIBC_2.2.5");
__asm__(".symver mhc_dlsym_base, dlsym@GLIBC_2.2.5");
__asm__(".symver mhc_pthread_once_base, pthread_once@GLIBC_2.2.5");
#define MHC_DLOPEN mhc_dlopen_base
#define MHC_DLSYM mhc_dlsym_base
#define MHC_PTHREAD_ONCE mhc_pthread_once_base
#else  // another target: its default versions (no floor is claimed for it)
void* __real_dlopen(const char* file, int mode);
void* __real_dlsym(void* handle, const char* name);
int __real_pthread_once(pthread_once_t* once, void (*init)());
#define MHC_DLOPEN __real_dlopen
#define MHC_DLSYM __real_dlsym
#define MHC_PTHREAD_ONCE __real_pthread_once
#endif

MHC_HIDDEN void* __wrap_dlopen(const char* file, int mode) { return MHC_DLOPEN(file, mode); }
MHC_HIDDEN void* __wrap_dlsym(void* handle, const char* name) { return MHC_DLSYM(handle, name); }
MHC_HIDDEN int __wrap_pthread_once(pthread_once_t* once, void (*init)()) { return MHC_PTHREAD_ONCE(once, init); }

}  // extern "C"
