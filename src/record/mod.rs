//! Recording: chat exchanges appended to a JSONL file (`[record]`) for `ctxproxy replay` and for
//! reading what the proxy did. A sampled request carries an [`Exchange`] through the handler;
//! its response body is watched ([`ResponseCapture`]) and, when it ends, the exchange goes to a
//! bounded queue. A writer thread serializes and writes; when the queue is full the record is
//! dropped and counted, so a slow disk never slows a request.

pub mod config;
mod entry;
mod writer;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use prometheus::{IntCounter, IntCounterVec};
use tokio::time::Instant;

pub use config::RecordConfig;
pub use entry::{Exchange, rfc3339};
pub use writer::{RotatingFile, rotated_path};

use crate::body::{BodyEnd, BodyObserver};
use crate::metrics::labels::RecordDrop;

/// The most response bytes kept for one record; a larger answer is recorded without its body.
const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;

pub enum Message {
    /// An exchange to write, and the bytes it counts in the queue's bound.
    Exchange(Box<Exchange>, usize),
    /// Flush, answer, and stop.
    Close(std::sync::mpsc::Sender<()>),
}

/// The recording side of the proxy: decides which requests are sampled and queues their
/// exchanges. Disabled (and free) when `[record] path` is empty.
pub struct Recorder {
    queue: Option<SyncSender<Message>>,
    /// Bytes of the exchanges queued, and at most how many (`queue_max_bytes`).
    queued_bytes: Arc<AtomicUsize>,
    max_queued_bytes: usize,
    sample_rate: f64,
    seen: AtomicU64,
    dropped: IntCounterVec,
}

impl Recorder {
    /// Starts the writer thread when recording is on.
    pub fn start(
        config: &RecordConfig,
        written: IntCounter,
        dropped: IntCounterVec,
    ) -> std::io::Result<Recorder> {
        let queued_bytes = Arc::new(AtomicUsize::new(0));
        let queue = if config.enabled() {
            let (sender, receiver): (SyncSender<Message>, Receiver<Message>) =
                std::sync::mpsc::sync_channel(config.queue_capacity);
            let config = config.clone();
            let metrics = writer::WriterMetrics {
                written,
                dropped: dropped.clone(),
                queued_bytes: queued_bytes.clone(),
            };
            std::thread::Builder::new()
                .name("ctxproxy-recorder".into())
                .spawn(move || writer::run(config, receiver, metrics))?;
            Some(sender)
        } else {
            None
        };
        Ok(Recorder {
            queue,
            queued_bytes,
            max_queued_bytes: config.queue_max_bytes,
            sample_rate: config.sample_rate,
            seen: AtomicU64::new(0),
            dropped,
        })
    }

    /// A new exchange when this request is sampled: `sample_rate` of the requests, evenly
    /// spread (the n-th is taken when ⌊n·rate⌋ steps up).
    pub fn sample(&self, request_id: &str, tenant: &str) -> Option<Exchange> {
        self.queue.as_ref()?;
        if self.sample_rate < 1.0 {
            let n = self.seen.fetch_add(1, Ordering::Relaxed) as f64;
            if ((n + 1.0) * self.sample_rate).floor() <= (n * self.sample_rate).floor() {
                return None;
            }
        }
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        Some(Exchange {
            unix_ms,
            request_id: request_id.to_owned(),
            tenant: tenant.to_owned(),
            ..Exchange::default()
        })
    }

    /// Queues a finished exchange, or drops and counts it when the queue is full (in
    /// exchanges or in bytes).
    fn submit(&self, exchange: Exchange) {
        let Some(queue) = &self.queue else {
            return;
        };
        let bytes = exchange.approximate_bytes();
        if bytes > self.max_queued_bytes {
            self.count_dropped(RecordDrop::TooLarge);
            return;
        }
        let queued = self.queued_bytes.fetch_add(bytes, Ordering::Relaxed);
        if queued + bytes > self.max_queued_bytes {
            self.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
            self.count_dropped(RecordDrop::QueueFull);
            return;
        }
        match queue.try_send(Message::Exchange(Box::new(exchange), bytes)) {
            Ok(()) => return,
            Err(TrySendError::Full(_)) => self.count_dropped(RecordDrop::QueueFull),
            Err(TrySendError::Disconnected(_)) => {
                self.count_dropped(RecordDrop::WriterStopped);
            }
        }
        self.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn count_dropped(&self, reason: RecordDrop) {
        self.dropped.with_label_values(&[reason.as_str()]).inc();
    }

    /// Waits (at most `timeout`) until everything queued so far is written; at shutdown.
    pub fn close(&self, timeout: Duration) {
        let Some(queue) = &self.queue else {
            return;
        };
        let deadline = std::time::Instant::now() + timeout;
        let (done, wait) = std::sync::mpsc::channel();
        let mut message = Message::Close(done);
        loop {
            match queue.try_send(message) {
                Ok(()) => break,
                Err(TrySendError::Full(back)) if std::time::Instant::now() < deadline => {
                    message = back;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(_) => return,
            }
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let _ = wait.recv_timeout(left);
    }
}

/// Watches a response body and, when it ends, completes the exchange and queues it.
pub struct ResponseCapture {
    recorder: Arc<Recorder>,
    exchange: Exchange,
    received: Instant,
    bytes: usize,
}

impl ResponseCapture {
    pub fn new(recorder: Arc<Recorder>, exchange: Exchange, received: Instant) -> Self {
        ResponseCapture {
            recorder,
            exchange,
            received,
            bytes: 0,
        }
    }
}

impl BodyObserver for ResponseCapture {
    fn on_data(&mut self, data: &Bytes) {
        if self.exchange.ttfb_ms.is_none() {
            self.exchange.ttfb_ms = Some(ms_since(self.received));
        }
        if self.exchange.response_truncated {
            return;
        }
        self.bytes += data.len();
        if self.bytes > MAX_RESPONSE_BYTES {
            self.exchange.response_truncated = true;
            self.exchange.response = Vec::new();
        } else {
            self.exchange.response.push(data.clone());
        }
    }

    fn on_end(self: Box<Self>, end: BodyEnd) {
        let mut this = *self;
        this.exchange.total_ms = ms_since(this.received);
        this.exchange.end = Some(end);
        this.recorder.submit(this.exchange);
    }
}

pub fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}
