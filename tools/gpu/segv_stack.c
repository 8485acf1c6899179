/* The native stack of a crash, for machines without gdb (the H100 and H200 machines had none).
 *
 *   cc -shared -fPIC -O1 -o /tmp/segv_stack.so tools/gpu/segv_stack.c
 *   LD_PRELOAD=/tmp/segv_stack.so python -m pytest ...
 *
 * On SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT it writes glibc's backtrace of the crashing
 * thread to stderr ("module(symbol+offset) [address]"; addr2line -f -C -e module offset
 * names a frame without a symbol), then dies by the same signal. Python's faulthandler
 * (pytest enables it) installs its handler after this one; it prints the Python stack and
 * then re-raises the signal through this handler, so both stacks appear. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static const int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

static void on_fatal(int sig) {
  static const char head[] = "\n== native stack (tools/gpu/segv_stack.c)\n";
  void* frames[64];
  const int n = backtrace(frames, 64);
  (void)!write(2, head, sizeof head - 1);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  void* warm[1];
  backtrace(warm, 1);  /* loads libgcc_s now: not inside the signal handler */
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_fatal;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i)
    sigaction(kSignals[i], &sa, NULL);
}
