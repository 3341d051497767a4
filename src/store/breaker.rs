//! A circuit breaker for the store: after a few consecutive failures it opens, and calls skip
//! Redis without waiting; one probe goes through per interval and closes it when Redis answers.
//! Transitions are logged once each, never once per request.
//!
//! A call holds a [`Call`] ticket; a probe whose future is dropped (its client left) gives the
//! probe back when the ticket drops, so a cancelled probe can never leave the breaker stuck.

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

    /// A ticket to use Redis for one call, or `None` to skip it. When open and the interval has
    /// passed, the caller becomes the probe. Report the outcome on the ticket; a ticket dropped
    /// without one (the call was cancelled) leaves the state as if the call never happened.
    pub fn allow(&self) -> Option<Call<'_>> {
        let mut state = self.state.lock().ok()?;
        match *state {
            State::Closed { .. } => Some(Call {
                breaker: self,
                probe: false,
            }),
            State::Open { retry_at } if Instant::now() >= retry_at => {
                *state = State::Probing;
                Some(Call {
                    breaker: self,
                    probe: true,
                })
            }
            State::Open { .. } | State::Probing => None,
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

/// One call's permission to use Redis (see [`Breaker::allow`]).
pub struct Call<'a> {
    breaker: &'a Breaker,
    /// Whether this call is the probe (its outcome is still owed).
    probe: bool,
}

impl Call<'_> {
    pub fn success(mut self) {
        self.probe = false;
        self.breaker.success();
    }

    pub fn failure(mut self, error: &str) {
        self.probe = false;
        self.breaker.failure(error);
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        if !self.probe {
            return;
        }
        // A cancelled probe learned nothing: the next call may probe at once.
        if let Ok(mut state) = self.breaker.state.lock()
            && *state == State::Probing
        {
            *state = State::Open {
                retry_at: Instant::now(),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_the_threshold_probes_once_and_closes_on_success() {
        let breaker = Breaker::new(2, Duration::from_millis(20));
        breaker.failure("x");
        assert!(breaker.allow().is_some() && breaker.is_closed());
        breaker.failure("x");
        assert!(breaker.allow().is_none() && !breaker.is_closed());
        std::thread::sleep(Duration::from_millis(25));
        let probe = breaker
            .allow()
            .expect("the first caller after the interval probes");
        assert!(breaker.allow().is_none(), "only one probe at a time");
        probe.failure("still down");
        assert!(breaker.allow().is_none());
        std::thread::sleep(Duration::from_millis(25));
        breaker.allow().expect("probe").success();
        assert!(breaker.allow().is_some() && breaker.is_closed());
    }

    #[test]
    fn a_dropped_probe_gives_the_probe_back() {
        let breaker = Breaker::new(1, Duration::from_millis(20));
        breaker.failure("down");
        std::thread::sleep(Duration::from_millis(25));
        let probe = breaker.allow().expect("probe");
        assert!(breaker.allow().is_none());
        // Its client left before Redis answered.
        drop(probe);
        let next = breaker.allow().expect("the next call probes at once");
        next.success();
        assert!(breaker.is_closed());
    }

    #[test]
    fn a_dropped_ordinary_call_changes_nothing() {
        let breaker = Breaker::new(2, Duration::from_millis(20));
        breaker.failure("x");
        drop(breaker.allow());
        breaker.failure("x");
        assert!(!breaker.is_closed(), "the failure count was kept");
    }
}
