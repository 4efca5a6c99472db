//! Credits: a sender never sends more messages than the peer has receive slots posted.

/// Flow control tied to the peer's posted receive ring.
///
/// Each side posts `ring` receives. A sender starts with `ring` credits and spends one per
/// message (a Send or a Write-with-immediate). The receiver reposts a slot as soon as its
/// message is decoded and returns the credit in the header of its next message, or in an
/// explicit Credit message once half the ring is owed. One credit is held back for that Credit
/// message, so both sides can always return credits and neither can stall the other.
///
/// The receiving side holds the peer to the same rule: it counts the credits it granted (the
/// ring, then every credit its messages returned) and refuses a message beyond them
/// ([`Credits::received`]), so a peer that ignores its credits cannot make this side take, and
/// answer, more messages than its ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credits {
    ring: u32,
    available: u32,
    owed: u32,
    /// Messages the peer may still send into our ring, by the credits we granted it.
    granted: u32,
}

impl Credits {
    /// Credits for a peer ring of `ring` slots (at least 2).
    pub fn new(ring: u32) -> Self {
        Self {
            ring,
            available: ring,
            owed: 0,
            granted: ring,
        }
    }

    /// Messages we may still send into the peer's ring.
    pub fn available(&self) -> u32 {
        self.available
    }

    /// Receive slots we reposted but have not yet told the peer about.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// True when a data message may go now (one credit stays in reserve for a Credit message).
    pub fn can_send_data(&self) -> bool {
        self.available >= 2
    }

    /// True when a Credit-only message is due and may go.
    pub fn credit_message_due(&self) -> bool {
        self.available >= 1 && self.owed >= (self.ring / 2).max(1)
    }

    /// Spends one credit and takes what we owe, to put in the outgoing header.
    ///
    /// # Panics
    /// Never; with no credit left it returns `None` and nothing changes.
    pub fn spend(&mut self) -> Option<u16> {
        if self.available == 0 {
            return None;
        }
        self.available -= 1;
        let owed = self.owed.min(u32::from(u16::MAX));
        self.owed -= owed;
        self.granted += owed;
        Some(owed as u16)
    }

    /// Spends one credit on a Write-with-immediate, which has no header to return credits in.
    pub fn spend_silent(&mut self) -> Option<()> {
        self.available = self.available.checked_sub(1)?;
        Some(())
    }

    /// A slot of ours was reposted.
    pub fn reposted(&mut self) {
        self.owed += 1;
    }

    /// A message (a Send or a Write-with-immediate) of the peer's took a slot of our ring.
    ///
    /// # Errors
    /// `Err(())` when the peer had no credit left for it: it is not following the protocol.
    #[allow(clippy::result_unit_err)]
    pub fn received(&mut self) -> Result<(), ()> {
        self.granted = self.granted.checked_sub(1).ok_or(())?;
        Ok(())
    }

    /// The peer returned `n` credits.
    ///
    /// # Errors
    /// `Err(())` when that would exceed the ring: the peer is lying.
    #[allow(clippy::result_unit_err)]
    pub fn returned(&mut self, n: u16) -> Result<(), ()> {
        let next = self.available + u32::from(n);
        if next > self.ring {
            return Err(());
        }
        self.available = next;
        Ok(())
    }
}
