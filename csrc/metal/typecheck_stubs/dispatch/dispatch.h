#pragma once
#include "../objc_base.h"
@protocol OS_dispatch_queue <NSObject>
@end
typedef NSObject<OS_dispatch_queue>* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);
extern "C" void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
