// The NCCL backend (distributed/nccl_communicator.h) as far as one GPU allows: the image's NCCL (2.28)
// refuses two ranks on one device, so a group of one joins through the run's TcpStore and every collective
// runs on device memory with a group of one's results (a sum of one, a gather of one), ordered on the
// engine's stream. The sharded model's collectives over NCCL need a GPU per rank (docs/parallel.md).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "core/device/device.h"
#include "core/tensor.h"
#include "distributed/nccl_communicator.h"
#include "distributed/tcp_store.h"
#include "gpu_test_util.h"

using namespace sparrow;

namespace {

std::vector<float> host(const Tensor& t) {
  Tensor h = t.to(Device::Cpu);
  return std::vector<float>(h.data(), h.data() + h.numel());
}

Tensor on_device(std::vector<float>& values, Shape shape) {
  return Tensor::view(values.data(), std::move(shape)).to(Device::Cuda);
}

}  // namespace

TEST(NcclCommunicator, AGroupOfOneRunsEveryCollectiveOnDeviceMemory) {
  SPARROW_REQUIRE_GPU();
  if (!nccl_available()) GTEST_SKIP() << "no libnccl.so.2 on the library path (SPARROW_NCCL_LIBRARY)";
  auto store = std::make_shared<TcpStore>("127.0.0.1", 0, true, std::chrono::milliseconds(30000));
  std::unique_ptr<Communicator> comm = connect_nccl(0, 1, store, "test");
  EXPECT_TRUE(comm->backend().starts_with("nccl 2.")) << comm->backend();
  std::printf("[ nccl ] %s\n", comm->backend().c_str());
  EXPECT_EQ(comm->device(), Device::Cuda);

  std::vector<float> values(1000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * float(i) - 7.0f;
  Tensor x = on_device(values, {1000});
  comm->all_reduce(x.raw(), x.numel(), ScalarType::F32);
  EXPECT_EQ(host(x), values);

  Tensor gathered = Tensor::zeros({1000}, ScalarType::F32, Device::Cuda);
  comm->all_gather(x.raw(), gathered.raw(), 1000, ScalarType::F32);
  EXPECT_EQ(host(gathered), values);
  Tensor scattered = Tensor::zeros({1000}, ScalarType::F32, Device::Cuda);
  comm->reduce_scatter(x.raw(), scattered.raw(), 1000, ScalarType::F32);
  EXPECT_EQ(host(scattered), values);
  Tensor exchanged = Tensor::zeros({1000}, ScalarType::F32, Device::Cuda);
  comm->all_to_all(x.raw(), exchanged.raw(), 1000, ScalarType::F32);
  EXPECT_EQ(host(exchanged), values);
  comm->broadcast(x.raw(), x.nbytes(), 0);
  EXPECT_EQ(host(x), values);
  comm->barrier();
}

// The copy that lays the ranks' column blocks side by side in ops::all_gather_columns on a GPU.
TEST(NcclCommunicator, ColumnBlocksCopyBetweenPitches) {
  SPARROW_REQUIRE_GPU();
  std::vector<float> values(6 * 10);
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i);
  Tensor src = on_device(values, {6, 10});
  Tensor dst = Tensor::zeros({6, 4}, ScalarType::F32, Device::Cuda);
  device::copy_device_2d(dst.as<uint8_t>() + 1 * 4, 4 * 4, src.as<uint8_t>() + 7 * 4, 10 * 4, 3 * 4, 6);
  const std::vector<float> got = host(dst);
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 4; ++c) EXPECT_EQ(got[size_t(r * 4 + c)], c == 0 ? 0.0f : float(r * 10 + 7 + c - 1));
}

TEST(NcclCommunicator, BadTypesAreRefused) {
  SPARROW_REQUIRE_GPU();
  if (!nccl_available()) GTEST_SKIP() << "no libnccl.so.2 on the library path (SPARROW_NCCL_LIBRARY)";
  auto store = std::make_shared<TcpStore>("127.0.0.1", 0, true, std::chrono::milliseconds(30000));
  std::unique_ptr<Communicator> comm = connect_nccl(0, 1, store, "types");
  Tensor codes = Tensor::zeros({16}, ScalarType::U8, Device::Cuda);
  EXPECT_THROW(comm->all_reduce(codes.raw(), 16, ScalarType::U8), Error);
}
