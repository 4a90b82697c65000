#pragma once
// Type-check stub of <os/signpost.h>: what torch's MPSProfiler.h names.
#include <stdint.h>
typedef uint64_t os_signpost_id_t;
typedef enum { OS_SIGNPOST_EVENT = 0, OS_SIGNPOST_INTERVAL_BEGIN = 1, OS_SIGNPOST_INTERVAL_END = 2 } os_signpost_type_t;
