#include "distributed/shm_broadcast.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "core/error.h"

namespace sparrow {

namespace {

constexpr uint64_t kMagic = 0x7370617272777368ull;  // "sparrwsh"
constexpr int kMaxReaders = 64;
constexpr std::chrono::microseconds kSpin{20};            // spun before sleeping: a plan due now
constexpr std::chrono::milliseconds kLivenessCheck{100};  // how often a sleeping wait looks at its peers

// A process that exists and has not exited (a zombie has, though kill() still finds it).
bool alive(pid_t pid) {
  if (pid <= 0) return true;  // not known yet: judged by the waits' own deadlines
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: kill() said it exists
  const size_t close = line.rfind(')');        // "pid (name) S ...": the name may hold spaces
  return close == std::string::npos || close + 2 >= line.size() || (line[close + 2] != 'Z' && line[close + 2] != 'X');
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds timeout) {
  const timespec ts{time_t(timeout.count() / 1000), long(timeout.count() % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

struct ShmRingHeader {
  uint64_t magic;
  uint32_t readers, slots;
  uint64_t slot_bytes;
  pid_t writer;
  std::atomic<pid_t> reader_pids[kMaxReaders];  // 0 until reader i opens
  std::atomic<uint64_t> pieces_read[kMaxReaders];  // how many pieces reader i has read
  std::atomic<uint32_t> opened;                 // readers that have opened (a futex word)
  std::atomic<uint32_t> published;              // bumped by every piece written (a futex word for the readers)
  std::atomic<uint32_t> consumed;               // bumped by every piece read (a futex word for the writer)
  struct Slot {
    std::atomic<uint64_t> seq;  // the piece's number + 1 once written; 0: never written
    uint32_t piece_bytes;
    uint64_t message_bytes;  // the whole message's size
  };
  // `slots` Slots follow the header, then the slots' data.
  Slot& slot(uint64_t i) { return reinterpret_cast<Slot*>(reinterpret_cast<uint8_t*>(this) + sizeof(ShmRingHeader))[i]; }
};

namespace {

size_t header_bytes(int slots) {
  const size_t bytes = sizeof(ShmRingHeader) + sizeof(ShmRingHeader::Slot) * size_t(slots);
  return (bytes + 63) / 64 * 64;
}

}  // namespace

std::unique_ptr<ShmBroadcast> ShmBroadcast::create(int readers, size_t slot_bytes, int slots) {
  SPARROW_CHECK(readers >= 1 && readers <= kMaxReaders, "shared-memory broadcast: ", readers, " readers (1 to ",
                kMaxReaders, ")");
  SPARROW_CHECK(slots >= 2 && slot_bytes >= 64 && slot_bytes <= UINT32_MAX, "shared-memory broadcast: ", slots,
                " slots of ", slot_bytes, " bytes");
  std::unique_ptr<ShmBroadcast> ring(new ShmBroadcast());
  static std::atomic<uint64_t> made{0};
  ring->name_ = "/sparrow-" + std::to_string(getpid()) + "-" + std::to_string(made++) + "-" +
                std::to_string(std::random_device{}());
  ring->bytes_ = header_bytes(slots) + slot_bytes * size_t(slots);
  const int fd = shm_open(ring->name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  SPARROW_CHECK(fd >= 0, "shared-memory broadcast: shm_open(", ring->name_, "): ", std::strerror(errno));
  // Reserved now, not on first touch: a full /dev/shm is an error here rather than a SIGBUS mid-step.
  if (const int error = posix_fallocate(fd, 0, off_t(ring->bytes_)); error != 0) {
    close(fd);
    shm_unlink(ring->name_.c_str());
    fail("shared-memory broadcast: cannot size ", ring->name_, " to ", ring->bytes_, " bytes: ", std::strerror(error),
         " (is /dev/shm large enough?)");
  }
  ring->base_ = mmap(nullptr, ring->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (ring->base_ == MAP_FAILED) {
    ring->base_ = nullptr;
    shm_unlink(ring->name_.c_str());
    fail("shared-memory broadcast: mmap of ", ring->name_, ": ", std::strerror(errno));
  }
  // A new segment reads as zeros, so every atomic starts at 0 (lock-free atomics are plain words).
  ring->header_ = static_cast<ShmRingHeader*>(ring->base_);
  ring->header_->readers = uint32_t(readers);
  ring->header_->slots = uint32_t(slots);
  ring->header_->slot_bytes = slot_bytes;
  ring->header_->writer = getpid();
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint64_t>*>(&ring->header_->magic)->store(kMagic, std::memory_order_release);
  return ring;
}

std::unique_ptr<ShmBroadcast> ShmBroadcast::open(const std::string& name, int index) {
  std::unique_ptr<ShmBroadcast> ring(new ShmBroadcast());
  ring->name_ = name;
  ring->index_ = index;
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  SPARROW_CHECK(fd >= 0, "shared-memory broadcast: cannot open ", name, ": ", std::strerror(errno));
  struct stat st{};
  if (fstat(fd, &st) != 0 || size_t(st.st_size) < header_bytes(2)) {
    close(fd);
    fail("shared-memory broadcast: ", name, " is not a broadcast segment");
  }
  ring->bytes_ = size_t(st.st_size);
  ring->base_ = mmap(nullptr, ring->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  SPARROW_CHECK(ring->base_ != MAP_FAILED, "shared-memory broadcast: mmap of ", name, ": ", std::strerror(errno));
  ring->header_ = static_cast<ShmRingHeader*>(ring->base_);
  const uint64_t magic = reinterpret_cast<std::atomic<uint64_t>*>(&ring->header_->magic)->load(std::memory_order_acquire);
  SPARROW_CHECK(magic == kMagic && ring->bytes_ == header_bytes(int(ring->header_->slots)) +
                                                       ring->header_->slot_bytes * ring->header_->slots,
                "shared-memory broadcast: ", name, " is not a broadcast segment");
  SPARROW_CHECK(index >= 0 && index < int(ring->header_->readers), "shared-memory broadcast: reader ", index, " of ",
                ring->header_->readers);
  pid_t none = 0;
  SPARROW_CHECK(ring->header_->reader_pids[index].compare_exchange_strong(none, getpid()),
                "shared-memory broadcast: reader ", index, " of ", name, " is open already");
  ring->header_->opened.fetch_add(1);
  futex_wake_all(&ring->header_->opened);
  return ring;
}

ShmBroadcast::~ShmBroadcast() {
  if (base_) munmap(base_, bytes_);
  if (index_ < 0 && !name_.empty()) shm_unlink(name_.c_str());  // a no-op once unlink() ran
}

void ShmBroadcast::unlink() { shm_unlink(name_.c_str()); }

uint8_t* ShmBroadcast::slot_data(int64_t slot) const {
  return static_cast<uint8_t*>(base_) + header_bytes(int(header_->slots)) + size_t(slot) * header_->slot_bytes;
}

namespace {

// Waits until done(): spins a moment, then sleeps on `word` (woken when it changes), looking every
// kLivenessCheck for a dead peer (dead() names it, or "") and for `deadline`.
template <typename Done, typename Dead>
void wait_until(const char* what, Done done, std::atomic<uint32_t>& word, Dead dead,
                std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max()) {
  const auto spin_end = std::chrono::steady_clock::now() + kSpin;
  while (std::chrono::steady_clock::now() < spin_end)
    if (done()) return;
  for (;;) {
    const uint32_t seen = word.load(std::memory_order_acquire);
    if (done()) return;
    futex_wait(&word, seen, kLivenessCheck);
    if (done()) return;
    const std::string gone = dead();
    SPARROW_CHECK(gone.empty(), "shared-memory broadcast: ", gone, " died while ", what);
    SPARROW_CHECK(std::chrono::steady_clock::now() < deadline, "shared-memory broadcast: timed out ", what);
  }
}

}  // namespace

void ShmBroadcast::wait_for_readers(std::chrono::milliseconds timeout) {
  SPARROW_CHECK(index_ < 0, "shared-memory broadcast: only the writer waits for its readers");
  wait_until(
      "waiting for its readers to open it", [&] { return header_->opened.load() == header_->readers; },
      header_->opened, [] { return std::string(); }, std::chrono::steady_clock::now() + timeout);
}

void ShmBroadcast::send(std::span<const uint8_t> bytes) {
  SPARROW_CHECK(index_ < 0, "shared-memory broadcast: a reader cannot send");
  ShmRingHeader& h = *header_;
  const size_t piece = h.slot_bytes;
  size_t sent = 0;
  do {  // a message of 0 bytes is one empty piece
    const uint64_t seq = next_seq_++;
    ShmRingHeader::Slot& slot = h.slot(seq % h.slots);
    // The slot is free once every reader has read the piece it held (`slots` pieces back).
    const uint64_t needed = seq >= h.slots ? seq - h.slots + 1 : 0;
    auto behind = [&](uint32_t r) { return h.pieces_read[r].load(std::memory_order_acquire) < needed; };
    wait_until(
        "waiting for a reader to take a step plan",
        [&] {
          for (uint32_t r = 0; r < h.readers; ++r)
            if (behind(r)) return false;
          return true;
        },
        h.consumed,
        [&] {  // only a reader the writer waits for matters: one that read everything may have ended
          for (uint32_t r = 0; r < h.readers; ++r)
            if (behind(r) && !alive(h.reader_pids[r].load())) return "reader " + std::to_string(r);
          return std::string();
        });
    const size_t n = std::min(piece, bytes.size() - sent);
    if (n > 0) std::memcpy(slot_data(int64_t(seq % h.slots)), bytes.data() + sent, n);
    slot.piece_bytes = uint32_t(n);
    slot.message_bytes = bytes.size();
    slot.seq.store(seq + 1, std::memory_order_release);
    h.published.fetch_add(1, std::memory_order_release);
    futex_wake_all(&h.published);
    sent += n;
  } while (sent < bytes.size());
}

std::vector<uint8_t> ShmBroadcast::receive() {
  SPARROW_CHECK(index_ >= 0, "shared-memory broadcast: the writer cannot receive");
  ShmRingHeader& h = *header_;
  auto dead_writer = [&] { return alive(h.writer) ? std::string() : std::string("the writer"); };
  std::vector<uint8_t> message;
  size_t received = 0;
  bool first = true;
  while (first || received < message.size()) {
    const uint64_t seq = next_seq_++;
    ShmRingHeader::Slot& slot = h.slot(seq % h.slots);
    wait_until(
        "waiting for the next step plan", [&] { return slot.seq.load(std::memory_order_acquire) == seq + 1; },
        h.published, dead_writer);
    if (first) {
      message.resize(slot.message_bytes);
      first = false;
    }
    SPARROW_CHECK(slot.message_bytes == message.size() && received + slot.piece_bytes <= message.size(),
                  "shared-memory broadcast: a piece of ", slot.piece_bytes, " bytes does not continue a message of ",
                  message.size());
    if (slot.piece_bytes > 0) std::memcpy(message.data() + received, slot_data(int64_t(seq % h.slots)), slot.piece_bytes);
    received += slot.piece_bytes;
    h.pieces_read[index_].store(seq + 1, std::memory_order_release);
    h.consumed.fetch_add(1, std::memory_order_release);
    futex_wake_all(&h.consumed);
  }
  return message;
}

namespace {

class ShmBroadcastCommunicator final : public Communicator {
 public:
  ShmBroadcastCommunicator(std::unique_ptr<Communicator> inner, std::unique_ptr<ShmBroadcast> ring)
      : inner_(std::move(inner)), ring_(std::move(ring)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Device device() const override { return inner_->device(); }
  std::string backend() const override { return inner_->backend() + " + shm broadcast"; }
  void all_reduce(void* data, int64_t count, ScalarType type) override { inner_->all_reduce(data, count, type); }
  void all_gather(const void* send, void* recv, int64_t count, ScalarType type) override {
    inner_->all_gather(send, recv, count, type);
  }
  void reduce_scatter(const void* send, void* recv, int64_t count, ScalarType type) override {
    inner_->reduce_scatter(send, recv, count, type);
  }
  void all_to_all(const void* send, void* recv, int64_t count, ScalarType type) override {
    inner_->all_to_all(send, recv, count, type);
  }
  void broadcast(void* data, int64_t bytes, int root) override {
    if (root != 0) return inner_->broadcast(data, bytes, root);
    if (rank() == 0) {
      ring_->send({static_cast<const uint8_t*>(data), size_t(bytes)});
      return;
    }
    const std::vector<uint8_t> message = ring_->receive();
    SPARROW_CHECK(int64_t(message.size()) == bytes, "shared-memory broadcast: ", message.size(),
                  " bytes came where ", bytes, " were expected");
    if (bytes > 0) std::memcpy(data, message.data(), size_t(bytes));
  }
  void send(const void* data, int64_t bytes, int peer) override { inner_->send(data, bytes, peer); }
  void recv(void* data, int64_t bytes, int peer) override { inner_->recv(data, bytes, peer); }
  void barrier() override { inner_->barrier(); }

 private:
  std::unique_ptr<Communicator> inner_;
  std::unique_ptr<ShmBroadcast> ring_;
};

}  // namespace

std::unique_ptr<Communicator> with_shm_broadcast(std::unique_ptr<Communicator> inner) {
  if (inner->size() < 2) return inner;
  std::unique_ptr<ShmBroadcast> ring;
  std::string name;
  if (inner->rank() == 0) {
    try {
      ring = ShmBroadcast::create(inner->size() - 1, size_t(256) << 10, 8);
      name = ring->name();
    } catch (const Error&) {  // no shared memory here: the broadcasts stay the communicator's
    }
  }
  int64_t length = int64_t(name.size());
  inner->broadcast(&length, sizeof(length), 0);
  name.resize(size_t(length));
  if (length > 0) inner->broadcast(name.data(), length, 0);
  int32_t failed = length == 0 ? 1 : 0;
  if (length > 0 && inner->rank() != 0) {
    try {
      ring = ShmBroadcast::open(name, inner->rank() - 1);
    } catch (const Error&) {  // another machine
      failed = 1;
    }
  }
  inner->all_reduce(&failed, 1, ScalarType::I32);
  if (ring && inner->rank() == 0) ring->unlink();  // every rank has tried to open it
  if (failed > 0) return inner;
  return std::make_unique<ShmBroadcastCommunicator>(std::move(inner), std::move(ring));
}

}  // namespace sparrow
