#include "formats/load_progress.h"

#include <algorithm>

namespace sparrow {

namespace {
std::string format(const char* pattern, double a, double b = 0, double c = 0, double d = 0) {
  char buf[160];
  std::snprintf(buf, sizeof buf, pattern, a, b, c, d);
  return buf;
}
constexpr double kGB = 1e9;
}  // namespace

LoadProgress::LoadProgress(int64_t total_bytes, std::FILE* out, bool live)
    : total_(std::max<int64_t>(total_bytes, 0)), out_(out), live_(live) {}

std::string LoadProgress::bar(int64_t done, int64_t total, double seconds) {
  const double percent = total > 0 ? 100.0 * double(std::min(done, total)) / double(total) : 100.0;
  return format("loading weights %3.0f%%  %.1f / %.1f GB  %.1f GB/s", percent, double(done) / kGB,
                double(total) / kGB, seconds > 0 ? double(done) / kGB / seconds : 0.0);
}

std::string LoadProgress::summary(int64_t bytes, double seconds) {
  return format("loaded %.1f GB of weights in %.1f s (%.2f GB/s)", double(bytes) / kGB, seconds,
                seconds > 0 ? double(bytes) / kGB / seconds : 0.0);
}

void LoadProgress::add(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  done_ += bytes;
  if (!out_ || finished_) return;
  const Clock::time_point now = Clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  if (live_) {
    if (now - last_draw_ < std::chrono::milliseconds(250)) return;
    last_draw_ = now;
    std::fprintf(out_, "\r%s", bar(done_, total_, elapsed).c_str());
  } else {
    const int tenth = total_ > 0 ? int(10 * std::min(done_, total_) / total_) : 10;
    if (tenth <= last_tenth_ || tenth >= 10) return;
    last_tenth_ = tenth;
    std::fprintf(out_, "%s\n", bar(done_, total_, elapsed).c_str());
  }
  std::fflush(out_);
}

int64_t LoadProgress::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

double LoadProgress::seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

void LoadProgress::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_) return;
  finished_ = true;
  if (!out_) return;
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  std::fprintf(out_, "%s%s\n", live_ ? "\r\033[K" : "", summary(done_, elapsed).c_str());
  std::fflush(out_);
}

}  // namespace sparrow
