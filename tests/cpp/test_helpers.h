#pragma once
// Helpers shared by the GoogleTest files.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

namespace splitgrad_test {

/// Runs `fn`, expects a c10::Error, and returns its message without the C++ backtrace.
inline std::string error_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected a c10::Error";
  return "";
}

}  // namespace splitgrad_test

#define EXPECT_CONTAINS(text, part)                          \
  EXPECT_NE(std::string(text).find(part), std::string::npos) \
      << "expected to find \"" << (part) << "\" in:\n"       \
      << (text)
