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
///
/// A side whose receives come from a pool shared by many connections (a server on a shared
/// receive queue) grants less than the ring at first ([`Credits::with_grants`]) and moves its
/// peer's window within `2..=ring` as the pool allows: [`Credits::grant`] adds credits beyond
/// the reposted slots, [`Credits::withhold`] keeps a reposted slot's credit for the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credits {
    ring: u32,
    available: u32,
    owed: u32,
    /// Messages the peer may still send into our ring, by the credits we granted it.
    granted: u32,
    /// The peer's window: the slots this side holds for it (credits it has, messages on their
    /// way or being handled, credits owed to it). At most `ring`.
    window: u32,
}

impl Credits {
    /// Credits for a peer ring of `ring` slots (at least 2).
    pub fn new(ring: u32) -> Self {
        Self::with_grants(ring, ring, ring)
    }

    /// Credits for rings of at most `ring` slots, where the peer grants this side `theirs`
    /// credits to start with and this side grants it `mine` (each within `2..=ring`).
    ///
    /// # Examples
    /// A server on a shared pool grants 2, and then more as its pool allows:
    /// ```
    /// use rdma_rpc_proto::Credits;
    /// let mut server = Credits::with_grants(64, 2, 64);
    /// assert_eq!(server.window(), 2);
    /// assert_eq!(server.grant(6), 6);
    /// assert_eq!((server.window(), server.owed()), (8, 6));
    /// assert_eq!(server.grant(100), 56); // never past the ring
    /// ```
    pub fn with_grants(ring: u32, mine: u32, theirs: u32) -> Self {
        let ring = ring.max(2);
        let (mine, theirs) = (mine.clamp(2, ring), theirs.clamp(2, ring));
        Self {
            ring,
            available: theirs,
            owed: 0,
            granted: mine,
            window: mine,
        }
    }

    /// The peer's window: how many of its messages this side holds slots for.
    pub fn window(&self) -> u32 {
        self.window
    }

    /// Whether the peer's last message used the last credit but the one every side holds back
    /// for a Credit message: it is sending as fast as its window lets it.
    pub fn peer_at_window(&self) -> bool {
        self.granted <= 1
    }

    /// Grants the peer up to `n` credits beyond the slots it used, within the ring; returns
    /// how many (they go with the next message, as reposted slots' credits do).
    pub fn grant(&mut self, n: u32) -> u32 {
        let n = n.min(self.ring - self.window);
        self.window += n;
        self.owed += n;
        n
    }

    /// A consumed slot's credit stays with this side instead of going back to the peer: its
    /// window shrinks by one. Refused (`false`) at a window of 2, below which the peer could
    /// not both send and return credits.
    pub fn withhold(&mut self) -> bool {
        if self.window <= 2 {
            return false;
        }
        self.window -= 1;
        true
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
        self.available >= 1 && self.owed >= (self.window / 2).max(1)
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
