#pragma once
// Type-check stub of <os/log.h>: what torch's MPSProfiler.h names.
#include "../objc_base.h"
@protocol OS_os_log <NSObject>
@end
typedef NSObject<OS_os_log>* os_log_t;
// Darwin's <time.h> extension, which MPSProfiler.h calls (declared here: Linux's libc lacks it).
#include <time.h>
extern "C" uint64_t clock_gettime_nsec_np(clockid_t clock_id);
