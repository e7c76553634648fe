//! A cancellation that a relay polls at every wake-up without taking a lock.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// A cancellation one task waits for: its future is polled once (which
/// registers the task's waker), after that only the token's flag is read, so
/// that waiting costs no lock per poll.
pub(crate) struct Watch {
    token: CancellationToken,
    fut: Pin<Box<WaitForCancellationFutureOwned>>,
    armed: bool,
}

impl Watch {
    pub(crate) fn new(token: &CancellationToken) -> Self {
        Watch {
            token: token.clone(),
            fut: Box::pin(token.clone().cancelled_owned()),
            armed: false,
        }
    }

    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.armed {
            // The waker registered at the first poll is this task's, the same
            // one at every poll: the cancel wakes it.
            if self.token.is_cancelled() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        } else {
            self.armed = true;
            self.fut.as_mut().poll(cx)
        }
    }
}
