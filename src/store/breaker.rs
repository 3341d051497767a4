//! A circuit breaker for the store: after a few consecutive failures it opens, and calls skip
//! Redis without waiting; one probe goes through per interval and closes it when Redis answers.
//! Transitions are logged once each, never once per request.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        retry_at: Instant,
    },
    /// One probe is in flight; everyone else still skips.
    Probing,
}

pub struct Breaker {
    state: Mutex<State>,
    threshold: u32,
    probe_every: Duration,
}

impl Breaker {
    pub fn new(threshold: u32, probe_every: Duration) -> Breaker {
        Breaker {
            state: Mutex::new(State::Closed { failures: 0 }),
            threshold: threshold.max(1),
            probe_every,
        }
    }

    /// Whether this call may use Redis. When open and the interval has passed, the caller
    /// becomes the probe.
    pub fn allow(&self) -> bool {
        let Ok(mut state) = self.state.lock() else {
            return false;
        };
        match *state {
            State::Closed { .. } => true,
            State::Open { retry_at } if Instant::now() >= retry_at => {
                *state = State::Probing;
                true
            }
            State::Open { .. } | State::Probing => false,
        }
    }

    pub fn is_closed(&self) -> bool {
        self.state
            .lock()
            .is_ok_and(|s| matches!(*s, State::Closed { .. }))
    }

    pub fn success(&self) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        if !matches!(*state, State::Closed { .. }) {
            tracing::info!("store: Redis answers again; shared state back in use");
        }
        *state = State::Closed { failures: 0 };
    }

    /// Opens at once (Redis found down at startup), logging the outage once.
    pub fn trip(&self, error: &str) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        if matches!(*state, State::Closed { .. }) {
            tracing::warn!(%error, "store: Redis is unreachable; using the in-memory store until it is back");
        }
        *state = State::Open {
            retry_at: Instant::now() + self.probe_every,
        };
    }

    pub fn failure(&self, error: &str) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        let retry_at = Instant::now() + self.probe_every;
        *state = match *state {
            State::Closed { failures } if failures + 1 < self.threshold => State::Closed {
                failures: failures + 1,
            },
            State::Closed { .. } => {
                tracing::warn!(%error, "store: Redis is unreachable; using the in-memory store until it is back");
                State::Open { retry_at }
            }
            State::Open { .. } | State::Probing => State::Open { retry_at },
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_the_threshold_probes_once_and_closes_on_success() {
        let breaker = Breaker::new(2, Duration::from_millis(20));
        breaker.failure("x");
        assert!(breaker.allow() && breaker.is_closed());
        breaker.failure("x");
        assert!(!breaker.allow() && !breaker.is_closed());
        std::thread::sleep(Duration::from_millis(25));
        assert!(
            breaker.allow(),
            "the first caller after the interval probes"
        );
        assert!(!breaker.allow(), "only one probe at a time");
        breaker.failure("still down");
        assert!(!breaker.allow());
        std::thread::sleep(Duration::from_millis(25));
        assert!(breaker.allow());
        breaker.success();
        assert!(breaker.allow() && breaker.is_closed());
    }
}
