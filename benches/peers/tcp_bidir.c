/*
 * tcp_bidir: the kernel's time for two processes that exchange SIZE bytes both ways at once
 * over loopback TCP, over one socket or over two one-way sockets (one per direction).
 *
 *   gcc -O2 -o tcp_bidir benches/peers/tcp_bidir.c
 *   ./tcp_bidir SIZE PIECE ITERS SPLIT
 *
 * Two processes pinned to CPUs 0 and 1, TCP_NODELAY, non-blocking sockets; each iteration
 * every process sends SIZE bytes in `send` calls of at most PIECE bytes and receives SIZE
 * bytes, one call of each in turn, until both are done. SPLIT=0: both directions on one
 * socket; 1: each process writes on its own socket and reads the other's. Prints the
 * median time per iteration (us) of the first process after dropping the first tenth.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now_us(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);sched_setaffinity(0,sizeof s,&s);}
static int cmp(const void*x,const void*y){double a=*(const double*)x,b=*(const double*)y;return a<b?-1:a>b;}
int main(int argc,char**argv){
  size_t size=atol(argv[1]),piece=atol(argv[2]); int iters=atoi(argv[3]), split=atoi(argv[4]); int one=1;
  int ls=socket(AF_INET,SOCK_STREAM,0); struct sockaddr_in a={0}; a.sin_family=AF_INET; a.sin_addr.s_addr=htonl(INADDR_LOOPBACK); socklen_t l=sizeof a;
  bind(ls,(void*)&a,sizeof a); getsockname(ls,(void*)&a,&l); listen(ls,4);
  char*sb=aligned_alloc(4096,size),*rb=aligned_alloc(4096,size); memset(sb,1,size); double*t=malloc(8*iters);
  pid_t ch=fork(); int me=ch==0; pin(me);
  int s0,s1;
  if(me){ s0=socket(AF_INET,SOCK_STREAM,0); connect(s0,(void*)&a,sizeof a); s1=socket(AF_INET,SOCK_STREAM,0); connect(s1,(void*)&a,sizeof a);} else { s0=accept(ls,0,0); s1=accept(ls,0,0);}
  setsockopt(s0,IPPROTO_TCP,TCP_NODELAY,&one,4); setsockopt(s1,IPPROTO_TCP,TCP_NODELAY,&one,4);
  fcntl(s0,F_SETFL,O_NONBLOCK); fcntl(s1,F_SETFL,O_NONBLOCK);
  int ws=s0, rs=s0; if(split){ ws= me? s0:s1; rs = me? s1:s0; }
  for(int i=0;i<iters;i++){ double t0=now_us(); size_t sent=0,got=0;
    while(sent<size||got<size){
      if(sent<size){ size_t k=size-sent<piece?size-sent:piece; ssize_t n=send(ws,sb+sent,k,MSG_NOSIGNAL); if(n>0) sent+=n; else if(errno!=EAGAIN&&errno!=EINTR){perror("send");exit(1);} }
      if(got<size){ ssize_t n=recv(rs,rb+got,size-got,0); if(n>0) got+=n; else if(n==0||(errno!=EAGAIN&&errno!=EINTR)){perror("recv");exit(1);} }
    }
    t[i]=now_us()-t0; }
  if(!me){ int sk=iters/10; qsort(t+sk,iters-sk,8,cmp); printf("bidir size %zu piece %zu split %d: median %.1f us\n",size,piece,split,t[sk+(iters-sk)/2]); waitpid(ch,0,0);} return 0;}
