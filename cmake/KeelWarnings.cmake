# Compiler flags every keel target shares: warnings, sanitizers, CPU tuning.
add_library(keel_flags INTERFACE)
target_compile_options(keel_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wno-unused-parameter>)
target_include_directories(keel_flags INTERFACE ${CMAKE_SOURCE_DIR})

if(KEEL_NATIVE)
  target_compile_options(keel_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
endif()

if(KEEL_SANITIZE)
  if(NOT KEEL_SANITIZE MATCHES "^(address|undefined|thread)$")
    message(FATAL_ERROR "KEEL_SANITIZE must be address, undefined or thread (got '${KEEL_SANITIZE}')")
  endif()
  target_compile_options(keel_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${KEEL_SANITIZE} -fno-omit-frame-pointer>)
  target_link_options(keel_flags INTERFACE -fsanitize=${KEEL_SANITIZE})
  if(KEEL_SANITIZE STREQUAL "thread")
    # GCC 12 warns that TSan cannot see the fences inside Boost.Asio's headers.
    target_compile_options(keel_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Wno-tsan>)
  endif()
endif()
