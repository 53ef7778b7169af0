#include "trainer/callback_runner.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace qstream {
namespace {

TEST(CallbackScopeTest, WithoutAScopeACallRunsAtOnce) {
  int runs = 0;
  int key = 0;
  CallbackScope::RunAtScopeEnd(&key, [&] { ++runs; });
  EXPECT_EQ(runs, 1);
  CallbackScope::RunAtScopeEnd(&key, [&] { ++runs; });
  EXPECT_EQ(runs, 2);  // nothing is remembered between calls
}

TEST(CallbackScopeTest, TheOutermostScopeRunsEachKeyOnceInTheOrderFirstAsked) {
  std::string log;
  int a = 0;
  int b = 0;
  {
    CallbackScope outer;
    CallbackScope::RunAtScopeEnd(&a, [&] { log += "a"; });
    {
      CallbackScope inner;
      CallbackScope::RunAtScopeEnd(&b, [&] { log += "b"; });
      CallbackScope::RunAtScopeEnd(&a, [&] { log += "A"; });  // a is queued: dropped
    }
    EXPECT_EQ(log, "");  // the inner scope's end runs nothing
    CallbackScope::RunAtScopeEnd(&b, [&] { log += "B"; });
    EXPECT_EQ(log, "");
  }
  EXPECT_EQ(log, "ab");
  // The next scope starts empty: the same keys run again.
  {
    CallbackScope scope;
    CallbackScope::RunAtScopeEnd(&b, [&] { log += "b"; });
  }
  EXPECT_EQ(log, "abb");
}

TEST(CallbackScopeTest, ACallMadeByADeferredCallRunsAtOnce) {
  std::string log;
  int a = 0;
  int b = 0;
  {
    CallbackScope scope;
    CallbackScope::RunAtScopeEnd(&a, [&] {
      log += "a(";
      CallbackScope::RunAtScopeEnd(&b, [&] { log += "b"; });
      CallbackScope::RunAtScopeEnd(&a, [&] { log += "a2"; });  // a itself, now outside any scope
      {
        CallbackScope nested;  // a scope opened by a deferred call defers again
        CallbackScope::RunAtScopeEnd(&b, [&] { log += "B"; });
        log += "|";
      }
      log += ")";
    });
  }
  EXPECT_EQ(log, "a(ba2|B)");
}

TEST(CallbackScopeTest, AScopeDefersOnlyItsOwnThread) {
  int key = 0;
  absl::Notification ran;
  CallbackScope scope;
  std::thread other([&] { CallbackScope::RunAtScopeEnd(&key, [&] { ran.Notify(); }); });
  other.join();
  EXPECT_TRUE(ran.HasBeenNotified());
}

// A group posted to the runner is one run: what its callbacks defer runs
// once, after the last of them.
TEST(CallbackRunnerTest, AGroupsDeferredCallsRunOnceAfterItsCallbacks) {
  CallbackRunner runner(1);
  std::vector<std::string> log;  // written by the runner's one thread only
  int key = 0;
  std::vector<std::function<void()>> callbacks;
  callbacks.reserve(5);
  for (int i = 0; i < 5; ++i) {
    callbacks.emplace_back([&, i] {
      log.emplace_back("cb" + std::to_string(i));
      CallbackScope::RunAtScopeEnd(&key, [&] { log.emplace_back("deferred"); });
    });
  }
  runner.Post(std::move(callbacks));
  runner.WaitIdle();
  EXPECT_EQ(log, (std::vector<std::string>{"cb0", "cb1", "cb2", "cb3", "cb4", "deferred"}));
  runner.Post({[&] { CallbackScope::RunAtScopeEnd(&key, [&] { log.emplace_back("next group"); }); }});
  runner.WaitIdle();
  EXPECT_EQ(log.back(), "next group");
}

}  // namespace
}  // namespace qstream
