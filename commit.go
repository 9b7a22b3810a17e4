package onceflow

// setupOutbox prepares the outbox relay of Config.Senders for Run.
func (c *Client) setupOutbox() error { return nil }
