//! The threads that serve connections: one single-threaded runtime per core, and each
//! connection served start to end on one of them (its requests, their pipeline, their upstream
//! calls), so that a request never waits for another thread to be woken. A work-stealing
//! runtime moves a request's tasks between threads on every wake-up; on a small machine that
//! handoff is a large part of what a proxy adds (`bench/load.sh`).
//!
//! A new connection goes to the thread with the fewest open, so a busy one gets new
//! connections last. Without `Cores::start` (tests, the mock), everything runs on the caller's
//! runtime. Work that would hold a serving thread for milliseconds (a large body's rewrite)
//! goes to a `Pool` of threads of its own, so that the thread's other connections go on.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use tokio::net::TcpStream;
use tokio::runtime::Handle;

thread_local! {
    /// The serving thread this is (0: the first, or a thread that is none of them).
    static CURRENT: Cell<usize> = const { Cell::new(0) };
    /// The connections open on each serving thread, on a serving thread.
    static OPEN: RefCell<Option<Arc<[AtomicUsize]>>> = const { RefCell::new(None) };
}

/// Which serving thread runs the caller: what per-thread resources (an upstream's connection
/// pool) are picked by. 0 outside them.
pub fn current() -> usize {
    CURRENT.get()
}

/// Whether the calling serving thread serves other connections than the caller's, which work
/// done here would hold up. False outside the serving threads of `Cores::start`.
pub fn shared() -> bool {
    OPEN.with_borrow(|open| {
        open.as_ref()
            .and_then(|open| open.get(current()))
            .is_some_and(|here| here.load(Ordering::Relaxed) > 1)
    })
}

/// The serving threads. The first is the thread that made them (its runtime runs the accept
/// loop too); the others run until `Cores` is dropped.
pub struct Cores {
    others: Vec<Other>,
    /// Connections open on each thread, the first included.
    open: Arc<[AtomicUsize]>,
}

/// A serving thread besides the first.
struct Other {
    handle: Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Cores {
    /// Connections served on the caller's runtime alone.
    pub fn none() -> Cores {
        Cores {
            others: Vec::new(),
            open: Arc::from([AtomicUsize::new(0)]),
        }
    }

    /// `threads` serving threads in all: the caller's, and `threads - 1` started here, each
    /// with a single-threaded runtime (timers and I/O) of its own.
    pub fn start(threads: usize) -> std::io::Result<Cores> {
        let threads = threads.max(1);
        let mut others = Vec::with_capacity(threads - 1);
        let open: Arc<[AtomicUsize]> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
        OPEN.set(Some(open.clone()));
        for index in 1..threads {
            let open = open.clone();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let handle = runtime.handle().clone();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name(format!("ctxproxy-core-{index}"))
                .spawn(move || {
                    CURRENT.set(index);
                    OPEN.set(Some(open));
                    runtime.block_on(async {
                        let _ = stopped.await;
                    });
                })?;
            others.push(Other {
                handle,
                stop: Some(stop),
                thread: Some(thread),
            });
        }
        Ok(Cores { others, open })
    }

    /// Serving threads in all.
    pub fn threads(&self) -> usize {
        self.open.len()
    }

    /// Serves `tcp` with `serve` on the thread with the fewest open connections. Called from
    /// the first thread's runtime.
    pub fn spawn<F, Fut>(&self, tcp: TcpStream, serve: F)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let index = self.least_busy();
        let open = OpenOn::new(self.open.clone(), index);
        let Some(other) = index.checked_sub(1).and_then(|i| self.others.get(i)) else {
            tokio::spawn(async move {
                serve(tcp).await;
                drop(open);
            });
            return;
        };
        // A socket is tied to the runtime that registered it: handed over unregistered.
        let tcp = match tcp.into_std() {
            Ok(tcp) => tcp,
            Err(e) => {
                tracing::debug!(error = %e, "cannot hand a connection to its thread");
                return;
            }
        };
        other.handle.spawn(async move {
            match TcpStream::from_std(tcp) {
                Ok(tcp) => serve(tcp).await,
                Err(e) => tracing::debug!(error = %e, "cannot register a connection"),
            }
            drop(open);
        });
    }

    fn least_busy(&self) -> usize {
        (0..self.open.len())
            .min_by_key(|&i| self.open[i].load(Ordering::Relaxed))
            .unwrap_or(0)
    }
}

impl Drop for Cores {
    fn drop(&mut self) {
        for other in &mut self.others {
            if let Some(stop) = other.stop.take() {
                let _ = stop.send(());
            }
        }
        for other in &mut self.others {
            if let Some(thread) = other.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

/// One open connection on thread `index`, counted until dropped.
struct OpenOn {
    open: Arc<[AtomicUsize]>,
    index: usize,
}

impl OpenOn {
    fn new(open: Arc<[AtomicUsize]>, index: usize) -> OpenOn {
        open[index].fetch_add(1, Ordering::Relaxed);
        OpenOn { open, index }
    }
}

impl Drop for OpenOn {
    fn drop(&mut self) {
        self.open[self.index].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Threads that run work too long for a serving thread: one per serving thread, which gives
/// it its work (`current`), so that what the work keeps per thread (token counts of words)
/// is kept where that thread's connections will want it again. They end when the pool is
/// dropped.
pub struct Pool {
    /// Each thread's queue, in the serving threads' order.
    jobs: Vec<mpsc::Sender<Job>>,
}

type Job = Box<dyn FnOnce() + Send>;

/// A job that ended without its result (it panicked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the work ended without a result")]
pub struct Lost;

impl Pool {
    /// `threads` threads, named `{name}-{index}`.
    pub fn start(name: &str, threads: usize) -> std::io::Result<Pool> {
        let mut jobs = Vec::with_capacity(threads.max(1));
        for index in 0..threads.max(1) {
            let (queue, queued) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(format!("{name}-{index}"))
                .spawn(move || {
                    for job in queued {
                        // A job that panics loses its result, not the thread.
                        let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
                    }
                })?;
            jobs.push(queue);
        }
        Ok(Pool { jobs })
    }

    /// `work`'s result, from the pool's thread of the calling serving thread.
    pub async fn run<R: Send + 'static>(
        &self,
        work: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, Lost> {
        let (done, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = done.send(work());
        });
        let queue = &self.jobs[current() % self.jobs.len()];
        if let Err(mpsc::SendError(job)) = queue.send(job) {
            // No thread left to take it (never while the pool lives): done here.
            job();
        }
        result.await.map_err(|_| Lost)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// Opens a connection to `listener`, served by `cores`: it answers with the serving
    /// thread it runs on, and stays open until the client closes it. That thread, and the
    /// client.
    async fn open(cores: &Cores, listener: &TcpListener) -> (u8, tokio::net::TcpStream) {
        open_telling(cores, listener, || current() as u8).await
    }

    /// `open`, the connection answering with what `tell` says on its serving thread.
    async fn open_telling(
        cores: &Cores,
        listener: &TcpListener,
        tell: fn() -> u8,
    ) -> (u8, tokio::net::TcpStream) {
        let addr = listener.local_addr().unwrap();
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (tcp, _) = listener.accept().await.unwrap();
        cores.spawn(tcp, move |mut tcp| async move {
            let _ = tcp.write_all(&[tell()]).await;
            let mut rest = Vec::new();
            let _ = tcp.read_to_end(&mut rest).await;
        });
        let mut thread = [0u8];
        client.read_exact(&mut thread).await.unwrap();
        (thread[0], client)
    }

    async fn listener() -> TcpListener {
        TcpListener::bind("127.0.0.1:0").await.unwrap()
    }

    #[tokio::test]
    async fn each_new_connection_goes_to_the_thread_with_the_fewest_open() {
        let (cores, listener) = (Cores::start(3).unwrap(), listener().await);
        assert_eq!(cores.threads(), 3);
        let mut clients = Vec::new();
        for expected in [0, 1, 2, 0, 1, 2] {
            let (thread, client) = open(&cores, &listener).await;
            assert_eq!(thread, expected);
            clients.push(client);
        }
    }

    #[tokio::test]
    async fn a_closed_connection_leaves_its_thread_free() {
        let (cores, listener) = (Cores::start(2).unwrap(), listener().await);
        let (_, _first) = open(&cores, &listener).await;
        let (thread, second) = open(&cores, &listener).await;
        assert_eq!(thread, 1);
        drop(second);
        for _ in 0..200 {
            if cores.open[1].load(Ordering::Relaxed) == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // The first thread still serves one: the second has none.
        assert_eq!(open(&cores, &listener).await.0, 1);
    }

    #[tokio::test]
    async fn a_thread_is_shared_once_it_serves_two_connections() {
        let (cores, listener) = (Cores::start(2).unwrap(), listener().await);
        let shared = || u8::from(shared());
        let mut told = Vec::new();
        let mut clients = Vec::new();
        for _ in 0..4 {
            let (tells, client) = open_telling(&cores, &listener, shared).await;
            told.push(tells);
            clients.push(client);
        }
        // One thread each for the first two, then each serves a second.
        assert_eq!(told, [0, 0, 1, 1]);
        assert!(!shared_outside());
    }

    /// `shared` on a thread that serves nothing.
    fn shared_outside() -> bool {
        std::thread::spawn(shared).join().unwrap()
    }

    #[tokio::test]
    async fn without_threads_of_their_own_connections_run_on_the_callers_runtime() {
        let (cores, listener) = (Cores::none(), listener().await);
        assert_eq!(cores.threads(), 1);
        let (a, _a) = open(&cores, &listener).await;
        let (b, _b) = open(&cores, &listener).await;
        assert_eq!((a, b), (0, 0));
    }

    #[tokio::test]
    async fn a_pools_work_runs_on_its_threads_and_a_panic_loses_only_its_result() {
        let pool = Pool::start("test-pool", 2).unwrap();
        let name = || std::thread::current().name().map(str::to_owned);
        // Outside the serving threads, work goes to the first.
        assert_eq!(
            pool.run(name).await.unwrap().as_deref(),
            Some("test-pool-0")
        );
        #[allow(clippy::panic)]
        let lost = pool.run(|| -> usize { panic!("a job that fails") }).await;
        assert_eq!(lost, Err(Lost));
        // The thread is still there.
        assert_eq!(
            pool.run(name).await.unwrap().as_deref(),
            Some("test-pool-0")
        );
    }

    #[test]
    fn each_serving_threads_work_goes_to_its_own_pool_thread() {
        let (cores, pool) = (
            Cores::start(2).unwrap(),
            Arc::new(Pool::start("own", 2).unwrap()),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let pool_on_other = pool.clone();
        cores.others[0].handle.spawn(async move {
            let name = pool_on_other.run(|| std::thread::current().name().map(str::to_owned));
            let _ = tx.send(name.await.ok().flatten());
        });
        assert_eq!(rx.recv().unwrap().as_deref(), Some("own-1"));
    }
}
