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
    /// What each serving thread serves, on a serving thread.
    static LOAD: RefCell<Option<Arc<Load>>> = const { RefCell::new(None) };
}

/// Which serving thread runs the caller: what per-thread resources (an upstream's connection
/// pool) are picked by. 0 outside them.
pub fn current() -> usize {
    CURRENT.get()
}

/// Whether the calling serving thread has other work than the caller's, which work done here
/// would hold up: another connection open or another request in progress (an HTTP/2 client's
/// streams share its connection), or, on the first of several threads, the accept loop that
/// feeds them all. False outside the serving threads of `Cores::start`.
pub fn shared() -> bool {
    LOAD.with_borrow(|load| {
        load.as_ref().is_some_and(|load| {
            let here = current();
            let more_than_one = |counts: &[AtomicUsize]| {
                counts
                    .get(here)
                    .is_some_and(|n| n.load(Ordering::Relaxed) > 1)
            };
            (here == 0 && load.threads() > 1)
                || more_than_one(&load.connections)
                || more_than_one(&load.requests)
        })
    })
}

/// One more request in progress on the calling serving thread, until the value is dropped
/// (wherever). `None` outside the serving threads of `Cores::start`.
pub fn begin_request() -> Option<Counted> {
    LOAD.with_borrow(|load| load.clone())
        .map(|load| Counted::new(load, current(), Kind::Request))
}

/// What each serving thread serves: its connections open, and its requests in progress.
struct Load {
    connections: Box<[AtomicUsize]>,
    requests: Box<[AtomicUsize]>,
}

impl Load {
    fn new(threads: usize) -> Load {
        let zeros = || (0..threads).map(|_| AtomicUsize::new(0)).collect();
        Load {
            connections: zeros(),
            requests: zeros(),
        }
    }

    fn threads(&self) -> usize {
        self.connections.len()
    }

    fn counts(&self, kind: Kind) -> &[AtomicUsize] {
        match kind {
            Kind::Connection => &self.connections,
            Kind::Request => &self.requests,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Connection,
    Request,
}

/// One connection open, or one request in progress, on serving thread `index`: counted until
/// dropped.
pub struct Counted {
    load: Arc<Load>,
    index: usize,
    kind: Kind,
}

impl Counted {
    fn new(load: Arc<Load>, index: usize, kind: Kind) -> Counted {
        if let Some(count) = load.counts(kind).get(index) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        Counted { load, index, kind }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if let Some(count) = self.load.counts(self.kind).get(self.index) {
            count.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The serving threads. The first is the thread that made them (its runtime runs the accept
/// loop too); the others run until `Cores` is dropped.
pub struct Cores {
    others: Vec<Other>,
    load: Arc<Load>,
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
            load: Arc::new(Load::new(1)),
        }
    }

    /// `threads` serving threads in all: the caller's, and `threads - 1` started here, each
    /// with a single-threaded runtime (timers and I/O) of its own.
    pub fn start(threads: usize) -> std::io::Result<Cores> {
        let threads = threads.max(1);
        let mut others = Vec::with_capacity(threads - 1);
        let load = Arc::new(Load::new(threads));
        LOAD.set(Some(load.clone()));
        for index in 1..threads {
            let load = load.clone();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let handle = runtime.handle().clone();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name(format!("ctxproxy-core-{index}"))
                .spawn(move || {
                    CURRENT.set(index);
                    LOAD.set(Some(load));
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
        Ok(Cores { others, load })
    }

    /// Serving threads in all.
    pub fn threads(&self) -> usize {
        self.load.threads()
    }

    /// Serves `tcp` with `serve` on the thread with the fewest open connections (the last
    /// such: the first also accepts). Called from the first thread's runtime.
    pub fn spawn<F, Fut>(&self, tcp: TcpStream, serve: F)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let index = self.least_busy();
        let open = Counted::new(self.load.clone(), index, Kind::Connection);
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
        let open = &self.load.connections;
        (0..open.len())
            .rev()
            .min_by_key(|&i| open[i].load(Ordering::Relaxed))
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

/// Threads that run work too long for a serving thread, one per serving thread. Work goes to
/// the calling serving thread's own (what the work keeps per thread, token counts of words, is
/// then kept where that thread's connections want it again), or, when that one has work
/// waiting, to the one with the least. Work whose caller is gone is skipped. The threads end
/// when the pool is dropped.
pub struct Pool {
    /// Each thread's queue, in the serving threads' order.
    jobs: Vec<mpsc::Sender<Job>>,
    /// Jobs sent to each thread and not finished.
    queued: Arc<[AtomicUsize]>,
}

type Job = Box<dyn FnOnce() + Send>;

/// A job that ended without its result (it panicked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the work ended without a result")]
pub struct Lost;

impl Pool {
    /// `threads` threads, named `{name}-{index}`.
    pub fn start(name: &str, threads: usize) -> std::io::Result<Pool> {
        let threads = threads.max(1);
        let mut jobs = Vec::with_capacity(threads);
        for index in 0..threads {
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
        let queued = (0..threads).map(|_| AtomicUsize::new(0)).collect();
        Ok(Pool { jobs, queued })
    }

    /// `work`'s result, from one of the pool's threads.
    pub async fn run<R: Send + 'static>(
        &self,
        work: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, Lost> {
        let (done, result) = tokio::sync::oneshot::channel();
        let index = self.least_queued();
        // Counted until the result is delivered, or lost (fields drop in order).
        let delivery = (Queued::new(self.queued.clone(), index), done);
        let job: Job = Box::new(move || {
            if delivery.1.is_closed() {
                return;
            }
            let result = work();
            let (queued, done) = delivery;
            drop(queued);
            let _ = done.send(result);
        });
        let sent = match self.jobs.get(index) {
            Some(queue) => queue.send(job).map_err(|mpsc::SendError(job)| job),
            None => Err(job),
        };
        if let Err(job) = sent {
            // No thread left to take it (never while the pool lives): done here.
            job();
        }
        result.await.map_err(|_| Lost)
    }

    /// The calling serving thread's own, unless others have less waiting.
    fn least_queued(&self) -> usize {
        let own = current() % self.queued.len();
        let waiting = |i: usize| self.queued[i].load(Ordering::Relaxed);
        if waiting(own) == 0 {
            return own;
        }
        (0..self.queued.len())
            .min_by_key(|&i| (waiting(i), i != own))
            .unwrap_or(own)
    }
}

/// One job sent to pool thread `index` and not finished, counted until dropped (also when it
/// panics).
struct Queued {
    queued: Arc<[AtomicUsize]>,
    index: usize,
}

impl Queued {
    fn new(queued: Arc<[AtomicUsize]>, index: usize) -> Queued {
        queued[index].fetch_add(1, Ordering::Relaxed);
        Queued { queued, index }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.queued[self.index].fetch_sub(1, Ordering::Relaxed);
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

    async fn bound() -> TcpListener {
        TcpListener::bind("127.0.0.1:0").await.unwrap()
    }

    #[tokio::test]
    async fn each_new_connection_goes_to_the_thread_with_the_fewest_open() {
        let (cores, listener) = (Cores::start(3).unwrap(), bound().await);
        assert_eq!(cores.threads(), 3);
        let mut clients = Vec::new();
        // The first thread, which also accepts, last among equals.
        for expected in [2, 1, 0, 2, 1, 0] {
            let (thread, client) = open(&cores, &listener).await;
            assert_eq!(thread, expected);
            clients.push(client);
        }
    }

    #[tokio::test]
    async fn a_closed_connection_leaves_its_thread_free() {
        let (cores, listener) = (Cores::start(2).unwrap(), bound().await);
        let (_, _first) = open(&cores, &listener).await;
        let (thread, second) = open(&cores, &listener).await;
        assert_eq!(thread, 0);
        drop(second);
        for _ in 0..200 {
            if cores.load.connections[0].load(Ordering::Relaxed) == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // The second thread still serves one: the first has none.
        assert_eq!(open(&cores, &listener).await.0, 0);
    }

    #[tokio::test]
    async fn a_thread_is_shared_by_a_second_connection_or_request_or_the_accept_loop() {
        let (cores, listener) = (Cores::start(2).unwrap(), bound().await);
        let tell_shared = || u8::from(shared());
        let mut told = Vec::new();
        let mut clients = Vec::new();
        for _ in 0..3 {
            let (tells, client) = open_telling(&cores, &listener, tell_shared).await;
            told.push(tells);
            clients.push(client);
        }
        // The second thread alone, then the first (it accepts), then the second again.
        assert_eq!(told, [0, 1, 1]);
        drop(clients);
        // One thread: no accept loop feeds others, and its requests tell.
        let (cores, listener) = (Cores::start(1).unwrap(), bound().await);
        let one_request = || {
            let _request = begin_request();
            u8::from(shared())
        };
        let two_requests = || {
            let _requests = (begin_request(), begin_request());
            u8::from(shared())
        };
        let (alone, first) = open_telling(&cores, &listener, one_request).await;
        drop(first);
        for _ in 0..200 {
            if cores.load.connections[0].load(Ordering::Relaxed) == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let (busy, _second) = open_telling(&cores, &listener, two_requests).await;
        assert_eq!((alone, busy), (0, 1));
        assert!(!shared_outside());
    }

    /// `shared` on a thread that serves nothing.
    fn shared_outside() -> bool {
        std::thread::spawn(shared).join().unwrap()
    }

    #[tokio::test]
    async fn without_threads_of_their_own_connections_run_on_the_callers_runtime() {
        let (cores, listener) = (Cores::none(), bound().await);
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

    #[tokio::test]
    async fn work_goes_elsewhere_while_its_own_thread_is_busy_and_is_skipped_once_unwanted() {
        let pool = Arc::new(Pool::start("busy", 2).unwrap());
        let name = || std::thread::current().name().map(str::to_owned);
        // A job that holds its thread until told; where it runs.
        let hold = |pool: &Arc<Pool>| {
            let (release, held) = std::sync::mpsc::channel::<()>();
            let pool = pool.clone();
            let job =
                tokio::spawn(async move { pool.run(move || (held.recv().is_ok(), name())).await });
            (release, job)
        };
        let wait_for = |pool: &Arc<Pool>, queued: [usize; 2]| {
            let pool = pool.clone();
            async move {
                for _ in 0..400 {
                    if (0..2).all(|i| pool.queued[i].load(Ordering::Relaxed) == queued[i]) {
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                panic!("never queued {queued:?}");
            }
        };
        let (release_first, first) = hold(&pool);
        wait_for(&pool, [1, 0]).await;
        // Its own thread is busy: the work goes to the idle one.
        assert_eq!(pool.run(name).await.unwrap().as_deref(), Some("busy-1"));
        let (release_second, second) = hold(&pool);
        wait_for(&pool, [1, 1]).await;
        // Both busy: behind its own; its caller leaves before the thread is free.
        let ran = Arc::new(AtomicUsize::new(0));
        let unwanted = {
            let (pool, ran) = (pool.clone(), ran.clone());
            tokio::spawn(async move { pool.run(move || ran.fetch_add(1, Ordering::Relaxed)).await })
        };
        wait_for(&pool, [2, 1]).await;
        unwanted.abort();
        let _ = unwanted.await;
        release_first.send(()).unwrap();
        release_second.send(()).unwrap();
        let first = first.await.unwrap().unwrap();
        let second = second.await.unwrap().unwrap();
        assert_eq!(first, (true, Some("busy-0".to_owned())));
        assert_eq!(second, (true, Some("busy-1".to_owned())));
        wait_for(&pool, [0, 0]).await;
        assert_eq!(ran.load(Ordering::Relaxed), 0);
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
