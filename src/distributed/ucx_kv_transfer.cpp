#include "distributed/ucx_kv_transfer.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <ucp/api/ucp.h>

#include "core/error.h"
#include "core/wire.h"

namespace sparrow {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint16_t kFetchMessage = 1;  // consumer -> producer
constexpr uint16_t kReplyMessage = 2;  // producer -> consumer
constexpr int kIndexBits = 24;         // a region's index in a tag; the ticket above it
constexpr uint64_t kIndexLimit = uint64_t(1) << kIndexBits;
constexpr std::chrono::seconds kCancelGrace{5};

void check(ucs_status_t status, const char* what) {
  SPARROW_CHECK(status == UCS_OK, "kv transfer (UCX): ", what, ": ", ucs_status_string(status));
}

sockaddr_storage resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
  SPARROW_CHECK(rc == 0 && found, "kv transfer: cannot resolve '", host, "': ", gai_strerror(rc));
  sockaddr_storage address{};
  std::memcpy(&address, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  return address;
}

// The wanted indices as runs [first, first + count), so that a fetch request stays a small message.
std::vector<std::pair<int64_t, int64_t>> as_runs(const std::vector<int64_t>& indices) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const int64_t i : indices) {
    if (!runs.empty() && runs.back().first + runs.back().second == i) ++runs.back().second;
    else runs.push_back({i, 1});
  }
  return runs;
}

class UcxKvTransfer final : public KvTransferAgent {
 public:
  UcxKvTransfer(const std::string& listen_host, int port, const std::string& advertised_host);
  ~UcxKvTransfer() override;

  KvPeer address() const override { return address_; }
  std::string backend() const override { return "ucx"; }
  void offer(const std::string& id, std::vector<KvRegion> regions, std::chrono::milliseconds expiry) override;
  void withdraw(const std::string& id) override;
  uint64_t fetch(const KvPeer& peer, const std::string& id, std::vector<std::pair<int64_t, KvRegion>> wanted,
                 std::chrono::milliseconds timeout) override;
  void cancel(uint64_t ticket) override;
  std::vector<KvTransferCompletion> poll() override;

 private:
  // One UCX operation in flight; its callback's user data.
  struct Operation {
    enum Kind { OfferSend, OfferReply, FetchRecv, FetchRequest };
    Operation(UcxKvTransfer* agent, Kind kind, std::string offer_id, uint64_t ticket, int64_t bytes)
        : agent(agent), kind(kind), offer_id(std::move(offer_id)), ticket(ticket), bytes(bytes) {}
    UcxKvTransfer* agent;
    Kind kind;
    std::string offer_id;  // OfferSend, OfferReply
    uint64_t ticket = 0;   // FetchRecv, FetchRequest
    int64_t bytes = 0;
    void* request = nullptr;          // UCX's handle while in flight (to cancel)
    std::vector<uint8_t> message;     // an active message's bytes, kept until sent
  };
  struct Offer {
    std::vector<KvRegion> regions;
    Clock::time_point deadline;
    bool fetched = false, withdrawn = false, failed = false;
    std::string error;
    ucp_ep_h ep = nullptr;  // the consumer's, from its fetch until the reply is under way
    uint64_t ticket = 0;    // the fetch's
    int64_t in_flight = 0, regions_sent = 0, bytes = 0;
    Clock::time_point started;
  };
  struct Fetch {
    std::string id;
    ucp_ep_h ep = nullptr;
    std::vector<Operation*> receives;  // still in flight
    int64_t in_flight = 0, regions = 0, bytes = 0;
    bool replied = false, failed = false;
    bool cancelled = false;  // cancel(): ends as failed once the producer's messages are in or the grace ran out
    std::string error;
    Clock::time_point started, deadline;
  };

  // UCX's context, worker and listener (the constructor's part that may throw).
  void start(const std::string& listen_host, int port, const std::string& advertised_host);
  // --- the agent's thread ---
  void loop();
  void run_commands();
  // Starts a UCX operation's bookkeeping from what the nbx call returned.
  void track(ucs_status_ptr_t status, Operation* op);
  void completed(Operation* op, ucs_status_t status);
  static void on_send(void* request, ucs_status_t status, void* user_data);
  static void on_receive(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data);
  static ucs_status_t on_fetch_message(void* arg, const void* header, size_t header_length, void* data,
                                       size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_reply_message(void* arg, const void* header, size_t header_length, void* data,
                                       size_t length, const ucp_am_recv_param_t* param);
  static void on_connection(ucp_conn_request_h request, void* arg);
  static void on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  void serve_fetch(ucp_ep_h ep, const std::vector<uint8_t>& message);
  void send_reply(ucp_ep_h ep, const std::string& offer_id, uint64_t ticket, const std::string& error);
  void fail_fetch(uint64_t ticket, const std::string& error);
  void check_deadlines();
  void settle();  // moves ended offers and fetches to the completions
  ucp_ep_h connect(const KvPeer& peer);
  void close_endpoint(ucp_ep_h ep);

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int worker_fd_ = -1, wake_fd_ = -1;
  KvPeer address_;
  std::map<std::string, ucp_ep_h> endpoints_;  // the consumer side's, by "host:port"
  std::vector<ucp_ep_h> accepted_;             // the producer side's
  std::unordered_map<std::string, Offer> offers_;
  std::unordered_map<uint64_t, Fetch> fetches_;
  std::vector<std::pair<ucp_ep_h, std::vector<uint8_t>>> incoming_;  // fetch requests received, not yet served

  // --- shared with the engine's thread ---
  std::mutex mutex_;
  std::deque<std::function<void()>> commands_;
  std::vector<KvTransferCompletion> completions_;
  std::atomic<uint64_t> next_ticket_{1};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

UcxKvTransfer::UcxKvTransfer(const std::string& listen_host, int port, const std::string& advertised_host) {
  try {
    start(listen_host, port, advertised_host);
  } catch (...) {
    // The destructor does not run for an object never made: let go of what UCX gave so far.
    if (listener_) ucp_listener_destroy(listener_);
    if (worker_) ucp_worker_destroy(worker_);
    if (context_) ucp_cleanup(context_);
    if (wake_fd_ >= 0) close(wake_fd_);
    throw;
  }
  thread_ = std::thread([this] { loop(); });
}

void UcxKvTransfer::start(const std::string& listen_host, int port, const std::string& advertised_host) {
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  check(ucp_init(&params, nullptr, &context_), "init");
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the agent's thread touches UCX
  check(ucp_worker_create(context_, &worker_params, &worker_), "worker");
  check(ucp_worker_get_efd(worker_, &worker_fd_), "worker's event fd");
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  SPARROW_CHECK(wake_fd_ >= 0, "kv transfer: eventfd: ", std::strerror(errno));

  for (const auto& [id, callback] : {std::pair{kFetchMessage, &UcxKvTransfer::on_fetch_message},
                                     std::pair{kReplyMessage, &UcxKvTransfer::on_reply_message}}) {
    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    handler.id = id;
    handler.cb = callback;
    handler.arg = this;
    handler.flags = UCP_AM_FLAG_WHOLE_MSG;
    check(ucp_worker_set_am_recv_handler(worker_, &handler), "active message handler");
  }

  const sockaddr_storage listen_at = resolve(listen_host, port);
  ucp_listener_params_t listener_params{};
  listener_params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  listener_params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&listen_at);
  listener_params.sockaddr.addrlen = sizeof(listen_at);
  listener_params.conn_handler.cb = &UcxKvTransfer::on_connection;
  listener_params.conn_handler.arg = this;
  const ucs_status_t listening = ucp_listener_create(worker_, &listener_params, &listener_);
  SPARROW_CHECK(listening == UCS_OK, "kv transfer: cannot listen on ", listen_host, ":", port, " (",
                ucs_status_string(listening), "); pick another kv_port in --kv-transfer-config");
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  check(ucp_listener_query(listener_, &attr), "listener's address");
  const auto* bound = reinterpret_cast<const sockaddr*>(&attr.sockaddr);
  address_.host = advertised_host;
  address_.port = ntohs(bound->sa_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(bound)->sin6_port
                                                     : reinterpret_cast<const sockaddr_in*>(bound)->sin_port);
}

UcxKvTransfer::~UcxKvTransfer() {
  stop_ = true;
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  // The thread is gone: nothing else touches UCX now. Cancel what is posted, close the endpoints, and let
  // the callbacks run before the worker goes.
  for (auto& [ticket, fetch] : fetches_)
    for (Operation* op : fetch.receives)
      if (op->request) ucp_request_cancel(worker_, op->request);
  std::vector<ucp_ep_h> all = accepted_;
  for (const auto& [name, ep] : endpoints_) all.push_back(ep);
  for (const ucp_ep_h ep : all) close_endpoint(ep);
  for (int i = 0; i < 1000 && ucp_worker_progress(worker_); ++i) {
  }
  if (listener_) ucp_listener_destroy(listener_);
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
  close(wake_fd_);
}

void UcxKvTransfer::close_endpoint(ucp_ep_h ep) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  const ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
  for (int i = 0; i < 100000 && ucp_request_check_status(request) == UCS_INPROGRESS; ++i) ucp_worker_progress(worker_);
  ucp_request_free(request);
}

// --- engine-thread calls: queue a command for the agent's thread ---

void UcxKvTransfer::offer(const std::string& id, std::vector<KvRegion> regions, std::chrono::milliseconds expiry) {
  SPARROW_CHECK(int64_t(regions.size()) < int64_t(kIndexLimit), "kv transfer: ", regions.size(), " regions in one offer");
  std::lock_guard lock(mutex_);
  commands_.push_back([this, id, regions = std::move(regions), expiry]() mutable {
    Offer& offer = offers_[id];
    offer.regions = std::move(regions);
    offer.deadline = Clock::now() + expiry;
  });
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

void UcxKvTransfer::withdraw(const std::string& id) {
  std::lock_guard lock(mutex_);
  commands_.push_back([this, id] {
    auto it = offers_.find(id);
    if (it == offers_.end()) return;
    it->second.withdrawn = true;
    if (!it->second.fetched) {
      it->second.failed = true;
      it->second.error = "withdrawn";
    }
  });
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

uint64_t UcxKvTransfer::fetch(const KvPeer& peer, const std::string& id,
                              std::vector<std::pair<int64_t, KvRegion>> wanted, std::chrono::milliseconds timeout) {
  const uint64_t ticket = next_ticket_++;
  std::lock_guard lock(mutex_);
  commands_.push_back([this, ticket, peer, id, wanted = std::move(wanted), timeout] {
    Fetch& fetch = fetches_[ticket];
    fetch.id = id;
    fetch.started = Clock::now();
    fetch.deadline = fetch.started + timeout;
    try {
      fetch.ep = connect(peer);
    } catch (const Error& e) {
      fetch.failed = true;
      fetch.error = e.what();
      return;
    }
    // Every region's receive is posted before the request goes, so no message arrives unexpected.
    std::vector<int64_t> indices;
    for (const auto& [index, region] : wanted) {
      SPARROW_CHECK(index >= 0 && uint64_t(index) < kIndexLimit, "kv transfer: region index ", index);
      indices.push_back(index);
      auto* op = new Operation(this, Operation::FetchRecv, {}, ticket, region.bytes);
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.recv = &UcxKvTransfer::on_receive;
      param.user_data = op;
      ++fetch.in_flight;
      fetch.receives.push_back(op);
      track(ucp_tag_recv_nbx(worker_, region.data, size_t(region.bytes), (ticket << kIndexBits) | uint64_t(index),
                             ~uint64_t(0), &param),
            op);
    }
    wire::Writer request;
    request.put<uint64_t>(ticket);
    request.put(id);
    const auto runs = as_runs(indices);
    request.put<uint64_t>(runs.size());
    for (const auto& [first, count] : runs) {
      request.put<int64_t>(first);
      request.put<int64_t>(count);
    }
    auto* op = new Operation(this, Operation::FetchRequest, {}, ticket, 0);
    op->message = std::move(request.bytes);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = &UcxKvTransfer::on_send;
    param.user_data = op;
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    ++fetch.in_flight;
    track(ucp_am_send_nbx(fetch.ep, kFetchMessage, nullptr, 0, op->message.data(), op->message.size(), &param), op);
  });
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  return ticket;
}

void UcxKvTransfer::cancel(uint64_t ticket) {
  std::lock_guard lock(mutex_);
  // The receives stay posted for a grace period: the producer may be sending already, and a message whose
  // receive is gone would never complete on its side (UCX's rendezvous waits for the receiver), holding its
  // blocks. A producer that sends nothing within the grace period gets its receives cancelled then.
  commands_.push_back([this, ticket] {
    auto it = fetches_.find(ticket);
    if (it == fetches_.end() || it->second.failed || it->second.cancelled) return;
    it->second.cancelled = true;
    it->second.deadline = std::min(it->second.deadline, Clock::now() + kCancelGrace);
  });
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

std::vector<KvTransferCompletion> UcxKvTransfer::poll() {
  std::lock_guard lock(mutex_);
  return std::exchange(completions_, {});
}

// --- the agent's thread ---

void UcxKvTransfer::loop() {
  while (!stop_) {
    while (ucp_worker_progress(worker_) != 0) {
    }
    run_commands();
    for (auto& [ep, message] : std::exchange(incoming_, {})) serve_fetch(ep, message);
    check_deadlines();
    settle();
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;  // more events came in meanwhile
    pollfd fds[2] = {{worker_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    ::poll(fds, 2, 50);  // wakes for deadlines too
    uint64_t drained;
    (void)!read(wake_fd_, &drained, sizeof(drained));
  }
}

void UcxKvTransfer::run_commands() {
  std::deque<std::function<void()>> commands;
  {
    std::lock_guard lock(mutex_);
    commands.swap(commands_);
  }
  for (auto& command : commands) command();
}

void UcxKvTransfer::track(ucs_status_ptr_t status, Operation* op) {
  if (status == nullptr) return completed(op, UCS_OK);  // done at once: no callback comes
  if (UCS_PTR_IS_ERR(status)) return completed(op, UCS_PTR_STATUS(status));
  op->request = status;
}

void UcxKvTransfer::on_send(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Operation*>(user_data);
  op->request = nullptr;
  ucp_request_free(request);
  op->agent->completed(op, status);
}

void UcxKvTransfer::on_receive(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
  auto* op = static_cast<Operation*>(user_data);
  op->request = nullptr;
  ucp_request_free(request);
  if (status == UCS_OK && int64_t(info->length) != op->bytes) status = UCS_ERR_MESSAGE_TRUNCATED;
  op->agent->completed(op, status);
}

void UcxKvTransfer::completed(Operation* op, ucs_status_t status) {
  std::unique_ptr<Operation> owned(op);
  const bool ok = status == UCS_OK;
  if (op->kind == Operation::OfferSend || op->kind == Operation::OfferReply) {
    auto it = offers_.find(op->offer_id);
    if (it == offers_.end()) return;
    Offer& offer = it->second;
    --offer.in_flight;
    if (ok && op->kind == Operation::OfferSend) {
      ++offer.regions_sent;
      offer.bytes += op->bytes;
    }
    if (!ok && !offer.failed) {
      offer.failed = true;
      offer.error = std::string("sending to the consumer failed: ") + ucs_status_string(status);
    }
    return;
  }
  auto it = fetches_.find(op->ticket);
  if (it == fetches_.end()) return;
  Fetch& fetch = it->second;
  --fetch.in_flight;
  if (op->kind == Operation::FetchRecv) {
    std::erase(fetch.receives, op);
    if (ok) {
      ++fetch.regions;
      fetch.bytes += op->bytes;
    }
  }
  if (!ok && !fetch.failed) {
    // One failed piece fails the fetch: the rest of its receives go too.
    owned.reset();
    fail_fetch(it->first, std::string("receiving from the producer failed: ") + ucs_status_string(status));
  }
}

void UcxKvTransfer::fail_fetch(uint64_t ticket, const std::string& error) {
  auto it = fetches_.find(ticket);
  if (it == fetches_.end() || it->second.failed) return;
  it->second.failed = true;
  it->second.error = error;
  const std::vector<Operation*> receives = it->second.receives;  // cancelling calls back into completed()
  for (Operation* op : receives)
    if (op->request) ucp_request_cancel(worker_, op->request);
}

ucs_status_t UcxKvTransfer::on_fetch_message(void* arg, const void*, size_t, void* data, size_t length,
                                             const ucp_am_recv_param_t* param) {
  auto* agent = static_cast<UcxKvTransfer*>(arg);
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))
    return UCS_OK;  // not a fetch this protocol sends (no reply endpoint, or too large): nothing to answer
  // Served after the queued commands (loop()): the engine offers before it hands anyone the transfer id, so an
  // offer whose fetch arrives in the same turn is registered by then.
  const auto* bytes = static_cast<const uint8_t*>(data);
  agent->incoming_.push_back({param->reply_ep, std::vector<uint8_t>(bytes, bytes + length)});
  return UCS_OK;
}

void UcxKvTransfer::serve_fetch(ucp_ep_h ep, const std::vector<uint8_t>& message) {
  uint64_t ticket = 0;
  std::string id;
  std::vector<int64_t> indices;
  try {
    wire::Reader reader(message, "kv fetch");
    ticket = reader.get<uint64_t>();
    id = reader.get_string();
    const uint64_t runs = reader.get_count(16);
    for (uint64_t r = 0; r < runs; ++r) {
      const int64_t first = reader.get<int64_t>(), count = reader.get<int64_t>();
      SPARROW_CHECK(first >= 0 && count > 0 && uint64_t(first + count) <= kIndexLimit, "kv fetch: regions ", first,
                    " + ", count);
      for (int64_t i = first; i < first + count; ++i) indices.push_back(i);
    }
    reader.finish();
  } catch (const Error& e) {
    return send_reply(ep, "", ticket, e.what());
  }
  auto it = offers_.find(id);
  if (it == offers_.end() || it->second.failed)
    return send_reply(ep, "", ticket, "no transfer '" + id + "' is offered here (it expired, was withdrawn, or never existed)");
  Offer& offer = it->second;
  if (offer.fetched) return send_reply(ep, "", ticket, "transfer '" + id + "' was already fetched");
  offer.fetched = true;
  offer.ep = ep;
  offer.ticket = ticket;
  offer.started = Clock::now();
  for (const int64_t index : indices)
    if (index >= int64_t(offer.regions.size())) {
      offer.failed = true;
      offer.error = "the consumer asked for region " + std::to_string(index) + " of " + std::to_string(offer.regions.size());
      return send_reply(ep, id, ticket, offer.error);
    }
  for (const int64_t index : indices) {
    const KvRegion& region = offer.regions[size_t(index)];
    auto* op = new Operation(this, Operation::OfferSend, id, ticket, region.bytes);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxKvTransfer::on_send;
    param.user_data = op;
    ++offer.in_flight;
    track(ucp_tag_send_nbx(ep, region.data, size_t(region.bytes), (ticket << kIndexBits) | uint64_t(index), &param), op);
  }
  // The reply goes once the regions are out (settle()).
}

void UcxKvTransfer::send_reply(ucp_ep_h ep, const std::string& offer_id, uint64_t ticket, const std::string& error) {
  wire::Writer reply;
  reply.put<uint64_t>(ticket);
  reply.put(error);
  auto* op = new Operation(this, Operation::OfferReply, offer_id, ticket, 0);
  op->message = std::move(reply.bytes);
  if (!offer_id.empty()) ++offers_.at(offer_id).in_flight;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &UcxKvTransfer::on_send;
  param.user_data = op;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  track(ucp_am_send_nbx(ep, kReplyMessage, nullptr, 0, op->message.data(), op->message.size(), &param), op);
}

ucs_status_t UcxKvTransfer::on_reply_message(void* arg, const void*, size_t, void* data, size_t length,
                                             const ucp_am_recv_param_t* param) {
  auto* agent = static_cast<UcxKvTransfer*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_OK;
  const auto* bytes = static_cast<const uint8_t*>(data);
  const std::vector<uint8_t> message(bytes, bytes + length);
  uint64_t ticket = 0;
  std::string error;
  try {
    wire::Reader reader(message, "kv fetch reply");
    ticket = reader.get<uint64_t>();
    error = reader.get_string();
    reader.finish();
  } catch (const Error&) {
    return UCS_OK;  // unreadable: the fetch times out
  }
  auto it = agent->fetches_.find(ticket);
  if (it == agent->fetches_.end()) return UCS_OK;
  if (!error.empty()) agent->fail_fetch(ticket, "the prefill instance: " + error);
  it->second.replied = true;
  return UCS_OK;
}

void UcxKvTransfer::on_connection(ucp_conn_request_h request, void* arg) {
  auto* agent = static_cast<UcxKvTransfer*>(arg);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.conn_request = request;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &UcxKvTransfer::on_endpoint_error;
  params.err_handler.arg = agent;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(agent->worker_, &params, &ep) == UCS_OK) agent->accepted_.push_back(ep);
}

void UcxKvTransfer::on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* agent = static_cast<UcxKvTransfer*>(arg);
  const std::string why = std::string("the peer's connection failed (") + ucs_status_string(status) + ")";
  for (auto& [id, offer] : agent->offers_)
    if (offer.ep == ep && !offer.failed) {
      offer.failed = true;
      offer.error = why;
    }
  std::vector<uint64_t> failing;
  for (auto& [ticket, fetch] : agent->fetches_)
    if (fetch.ep == ep) failing.push_back(ticket);
  for (const uint64_t ticket : failing) agent->fail_fetch(ticket, "the prefill instance's " + why.substr(4));
  // The endpoint is useless now: a later fetch from that peer connects anew. (Closed at destruction.)
  for (auto it = agent->endpoints_.begin(); it != agent->endpoints_.end(); ++it)
    if (it->second == ep) {
      agent->accepted_.push_back(ep);  // closed with the others
      agent->endpoints_.erase(it);
      break;
    }
}

ucp_ep_h UcxKvTransfer::connect(const KvPeer& peer) {
  const std::string name = peer.host + ":" + std::to_string(peer.port);
  if (auto it = endpoints_.find(name); it != endpoints_.end()) return it->second;
  const sockaddr_storage address = resolve(peer.host, peer.port);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
  params.sockaddr.addrlen = sizeof(address);
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &UcxKvTransfer::on_endpoint_error;
  params.err_handler.arg = this;
  ucp_ep_h ep = nullptr;
  const ucs_status_t status = ucp_ep_create(worker_, &params, &ep);
  SPARROW_CHECK(status == UCS_OK, "kv transfer: cannot connect to the prefill instance at ", name, ": ",
                ucs_status_string(status));
  endpoints_[name] = ep;
  return ep;
}

void UcxKvTransfer::check_deadlines() {
  const auto now = Clock::now();
  for (auto& [id, offer] : offers_)
    if (!offer.fetched && !offer.failed && now > offer.deadline) {
      offer.failed = true;
      offer.error = "expired before a decode instance fetched it";
    }
  std::vector<uint64_t> late;
  for (auto& [ticket, fetch] : fetches_)
    if (!fetch.failed && now > fetch.deadline) late.push_back(ticket);
  for (const uint64_t ticket : late) fail_fetch(ticket, fetches_.at(ticket).cancelled ? "cancelled" : "timed out");
}

void UcxKvTransfer::settle() {
  std::vector<KvTransferCompletion> done;
  for (auto it = offers_.begin(); it != offers_.end();) {
    Offer& offer = it->second;
    // A fetched offer whose regions are all sent answers once; it ends when that answer is out.
    if (offer.fetched && !offer.failed && offer.in_flight == 0 && offer.ep)
      send_reply(std::exchange(offer.ep, nullptr), it->first, offer.ticket, "");
    if (offer.in_flight == 0 && (offer.failed || (offer.fetched && offer.ep == nullptr))) {
      KvTransferCompletion c;
      c.kind = KvTransferCompletion::Kind::Offer;
      c.id = it->first;
      c.ok = !offer.failed;
      c.error = offer.error;
      c.regions = offer.regions_sent;
      c.bytes = offer.bytes;
      c.seconds = offer.fetched ? std::chrono::duration<double>(Clock::now() - offer.started).count() : 0;
      done.push_back(std::move(c));
      it = offers_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = fetches_.begin(); it != fetches_.end();) {
    Fetch& fetch = it->second;
    if (fetch.in_flight == 0 && fetch.cancelled && !fetch.failed) {
      fetch.failed = true;
      fetch.error = "cancelled";
    }
    if (fetch.in_flight == 0 && (fetch.failed || fetch.replied)) {
      KvTransferCompletion c;
      c.kind = KvTransferCompletion::Kind::Fetch;
      c.id = fetch.id;
      c.ticket = it->first;
      c.ok = !fetch.failed;
      c.error = fetch.error;
      c.regions = fetch.regions;
      c.bytes = fetch.bytes;
      c.seconds = std::chrono::duration<double>(Clock::now() - fetch.started).count();
      done.push_back(std::move(c));
      it = fetches_.erase(it);
    } else {
      ++it;
    }
  }
  if (done.empty()) return;
  std::lock_guard lock(mutex_);
  for (auto& c : done) completions_.push_back(std::move(c));
}

}  // namespace

std::unique_ptr<KvTransferAgent> make_ucx_kv_transfer(const std::string& listen_host, int port,
                                                      const std::string& advertised_host) {
  return std::make_unique<UcxKvTransfer>(listen_host, port, advertised_host);
}

}  // namespace sparrow
