// What the CPU backend's batch-invariant products cost (kernels/cpu/reference_ops.cpp, kRowTile): OpenBLAS
// sgemm on all rows at once against the same product in calls of exactly 8 rows (a partial tile padded),
// single-threaded, at a decode and a prefill shape. Not part of the build:
//   g++ -O2 -std=c++20 tools/gemm_row_tiles_bench.cpp -o /tmp/gemm_row_tiles -lopenblas && /tmp/gemm_row_tiles
// Results: bench/results/cpu.md.
#include <cblas.h>
#include <chrono>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <tuple>
static void tiled(int m,int n,int k,const float*x,const float*w,float*y){
  const int T=8; int full=m/T*T;
  for(int r=0;r<full;r+=T) cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasTrans,T,n,k,1,x+r*k,k,w,k,0,y+r*n,n);
  if(full<m){ std::vector<float> xt(T*k,0),yt(T*n); std::copy(x+full*k,x+m*k,xt.begin());
    cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasTrans,T,n,k,1,xt.data(),k,w,k,0,yt.data(),n);
    std::copy(yt.begin(),yt.begin()+(m-full)*n,y+full*n);}
}
int main(){
  openblas_set_num_threads(1);
  for (auto [m,n,k] : std::vector<std::tuple<int,int,int>>{{1,1024,1024},{4,1024,1024},{256,1024,1024},{256,4096,1024}}){
    std::vector<float> x(m*k,0.1f),w(n*k,0.2f),y(m*n);
    auto time=[&](bool t){ auto s=std::chrono::steady_clock::now(); int it=0; do{ if(t) tiled(m,n,k,x.data(),w.data(),y.data()); else cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasTrans,m,n,k,1,x.data(),k,w.data(),k,0,y.data(),n); ++it;}while(std::chrono::steady_clock::now()-s<std::chrono::milliseconds(300)); return std::chrono::duration<double,std::micro>(std::chrono::steady_clock::now()-s).count()/it;};
    double a=time(false), b=time(true), a2=time(false), b2=time(true);
    std::printf("m=%d n=%d k=%d plain %.1f us tiled %.1f us (%.2fx)\n",m,n,k,std::min(a,a2),std::min(b,b2),std::min(b,b2)/std::min(a,a2));
  }
}
