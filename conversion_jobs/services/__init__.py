"""Every write and transition of the domain. Each transition is one guarded UPDATE."""
