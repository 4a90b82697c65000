#pragma once
typedef long NSInteger;
typedef unsigned long NSUInteger;
typedef bool BOOL;  // arm64 (objc/objc.h: OBJC_BOOL_IS_BOOL); signed char only on x86_64
#define YES __objc_yes
#define NO __objc_no
#define nil nullptr
#define Nil nullptr
#define NS_ENUM(_type, _name) enum _name : _type _name; enum _name : _type
#define API_AVAILABLE(...)
#define API_DEPRECATED(...)
@protocol NSObject
@end
@protocol NSCopying
@end
__attribute__((objc_root_class))
@interface NSObject <NSObject> { Class isa; }
+ (instancetype)alloc;
+ (instancetype)new;
- (instancetype)init;
@end
